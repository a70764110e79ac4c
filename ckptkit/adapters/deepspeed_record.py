"""The ``deepspeed`` JSON record: one builder for a live save and for an import of DeepSpeed's own files.

Next to its tensors, a checkpoint of :mod:`ckptkit.adapters.deepspeed` holds one JSON string (state
key ``deepspeed``) that describes the engine: counters, the optimizer's param groups and per-group
scalar states, the LR scheduler, the DeepSpeed config, the client state, and the saving layout.
Two writers make it — :func:`ckptkit.adapters.deepspeed.engine_state` from a live engine, and
``ckptkit_converters.deepspeed`` from a native ``engine.save_checkpoint`` folder — and ``load`` and
the exporters read it. Built in two places, the copies drifted apart (the importer once wrote as
strings what the adapter refused, kept scalar states the adapter refused, took fp16 folders whose
loss scaler the adapter refuses to drop, and read records of any format version). So both writers
call :func:`build_record`, and both readers :func:`parse_record`, with one set of rules:

* framework values (param groups without their ``params``, the scheduler's ``state_dict``,
  ``ds_config``, client-state entries): :func:`ckptkit.layout.values.json_ready` — kept exactly, or
  refused naming where they came from and the key path; ``ds_config`` must be a dict (None: ``{}``);
* per-group optimizer scalars (Adam's ``step``): :func:`scalar_record` — a one-element tensor by
  dtype and value, or a plain number; anything else is refused;
* fp16 training is refused: DeepSpeed's dynamic loss scaler is not carried. bf16 and fp32 run with
  DeepSpeed's static scale of 1.0, which is all a native export writes back (its ``LossScaler(1.0)``);
  neither the loss scaler nor ZeRO's ``fragment_address`` records are stored: the layout in the
  record (``flat_groups``, ``param_shapes``) is what both are rebuilt from;
* the record's format version is :data:`FORMAT`; a reader refuses any other.

Where the two writers still differ, on purpose: a client-state entry that JSON cannot keep fails a
live save (its caller can fix it), while an import leaves it out and lists it in the manifest's
``converted_from`` (a native folder cannot be fixed) — the same refusal, see
:func:`client_state_record`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptkit.engine.state import dtype_name
from ckptkit.errors import StateMismatchError
from ckptkit.layout.values import json_ready

META = "deepspeed"
"""State key of the JSON string that describes the engine (counters, scheduler, client state, layout)."""
FORMAT = 1
"""Version of the record; :func:`parse_record` refuses others."""
RECORD_KEY = f"deepspeed_engine/{META}"
"""Where the record sits among a checkpoint's values (the adapter saves under ``deepspeed_engine``)."""
CLIENT_STATE = "client_state"
"""State key of a live save's client state (its JSON text), apart from the record: a client state may
differ between ranks (each rank's data-loader position), the record must not, or the saver's merge
stores it per rank and no load finds it. A record that still holds ``client_state`` (an import of a
native folder, a checkpoint saved before the split) is read as before."""
CLIENT_KEY = f"deepspeed_engine/{CLIENT_STATE}"
"""Where the client state sits among a checkpoint's values: agreed, or per rank when the ranks differed."""


def split_client_state(record: dict[str, Any]) -> str:
    """Take the client state out of a live save's ``record`` (the same on every rank then), as the JSON
    text stored at :data:`CLIENT_KEY`."""
    return json.dumps(record.pop(CLIENT_STATE))


@dataclass(frozen=True)
class RecordSources:
    """Where the non-tensor records were read, so that a refusal names the file (an import) or the
    engine (a live save): ``model_states`` holds the counters, scheduler, config and client state;
    ``optimizer`` the param groups."""

    model_states: str
    optimizer: str


@dataclass(frozen=True)
class Counters:
    """The engine's step counters; ``micro_steps`` is kept as the writer knows it (a live engine's own
    counter, or ``global_steps × gradient_accumulation_steps`` for a native folder, which has none)."""

    global_steps: int
    global_samples: int
    skipped_steps: int
    micro_steps: int
    gradient_accumulation_steps: int


@dataclass(frozen=True)
class SavedLayout:
    """How the tensors were saved: the ZeRO stage and DP size, the training dtype, the flat groups
    (members by model-space name, expert group name), shapes, per-group optimizer scalars
    (:func:`scalar_record` each), the state tensor kinds, and the module tensors outside the groups."""

    zero_stage: int
    dp: int
    lp_dtype: torch.dtype
    flat_groups: Sequence[Mapping[str, Any]]
    param_shapes: Mapping[str, Sequence[int]]
    optimizer_scalars: Sequence[Mapping[str, Any]]
    optimizer_state_keys: Sequence[str]
    buffers: Sequence[str]
    frozen: Sequence[str]
    shared: Mapping[str, str]
    experts: Mapping[str, Any]


@dataclass(frozen=True)
class FrameworkState:
    """DeepSpeed's non-tensor state as the writer found it: the optimizer's param groups (with their
    ``params``, dropped here), the scheduler's ``state_dict`` (None without one), ``ds_config`` and
    the client state already through :func:`client_state_record`."""

    param_groups: Sequence[Mapping[str, Any]]
    lr_scheduler: Any
    ds_config: Any
    client_state: Mapping[str, Any]
    sources: RecordSources


def build_record(layout: SavedLayout, counters: Counters, state: FrameworkState) -> dict[str, Any]:
    """The record of one checkpoint, as a dict ready for ``json.dumps``, by the rules of the module
    docstring; StateMismatchError naming the source and key path of the first part it cannot keep."""
    where = state.sources
    if layout.lp_dtype == torch.float16:
        raise StateMismatchError(f"{where.model_states}: fp16 training; the dynamic loss scaler's state is not "
                                 "carried by ckptkit's DeepSpeed record (use bf16 or fp32)")
    return {
        "format": FORMAT, "stage": layout.zero_stage, "dp": layout.dp, "lp_dtype": dtype_name(layout.lp_dtype),
        "global_steps": counters.global_steps, "global_samples": counters.global_samples,
        "skipped_steps": counters.skipped_steps, "micro_steps": counters.micro_steps,
        "gradient_accumulation_steps": counters.gradient_accumulation_steps,
        "param_groups": [json_ready({k: v for k, v in pg.items() if k != "params"},
                                    f"{where.optimizer}: optimizer param group {g}")
                         for g, pg in enumerate(state.param_groups)],
        "optimizer_scalars": [dict(s) for s in layout.optimizer_scalars],
        "flat_groups": [dict(fg) for fg in layout.flat_groups],
        "param_shapes": {n: list(s) for n, s in layout.param_shapes.items()},
        "buffers": list(layout.buffers), "frozen": list(layout.frozen), "shared": dict(layout.shared),
        "experts": dict(layout.experts),
        "ds_config": ds_config_record(state.ds_config, where.model_states),
        "optimizer_state_keys": list(layout.optimizer_state_keys),
        "lr_scheduler": json_ready(state.lr_scheduler, f"{where.model_states}: lr_scheduler"),
        "client_state": json_ready(dict(state.client_state), f"{where.model_states}: client state"),
    }


def ds_config_record(config: Any, where: str) -> dict[str, Any]:
    """``ds_config`` as the record keeps it: a dict kept exactly (None or empty: ``{}``), anything
    else refused — DeepSpeed's engine always holds its config as a dict, and the import reads its
    layout options (``zero_optimization``) from it."""
    config = config or {}
    if not isinstance(config, Mapping):
        raise StateMismatchError(f"{where}: ds_config is a {type(config).__name__}, not the DeepSpeed config dict")
    return json_ready(config, f"{where}: ds_config")


def client_state_record(entries: Mapping[Any, Any], where: str) -> tuple[dict[str, Any], dict[str, StateMismatchError]]:
    """The client-state entries JSON keeps exactly, and why each other one is refused (by its name, a
    non-string key by its ``ascii``). A live save raises the first refusal; an import lists the names."""
    kept: dict[str, Any] = {}
    refused: dict[str, StateMismatchError] = {}
    for key, value in entries.items():
        if not isinstance(key, str):
            refused[ascii(key)] = StateMismatchError(f"{where}: client state key {key!r} is not a string")
            continue
        try:
            kept[key] = json_ready(value, f"{where}: client state {key!r}")
        except StateMismatchError as exc:
            refused[key] = exc
    return kept, refused


def scalar_record(value: Any, what: str) -> dict[str, Any]:
    """One per-group optimizer state that is not a partition-shaped tensor (Adam's ``step``), as the
    record keeps it: a one-element tensor by dtype and value, a plain number with dtype None;
    anything else refused naming ``what`` (a torch optimizer's scalar state is one of these two)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise StateMismatchError(f"{what}: a tensor of shape {list(value.shape)}, neither a flat state tensor "
                                     "of the partition nor a scalar")
        return {"dtype": dtype_name(value.dtype), "value": value.item()}
    if isinstance(value, (int, float)):
        return {"dtype": None, "value": json_ready(value, what)}
    raise StateMismatchError(f"{what}: a {type(value).__module__}.{type(value).__qualname__}, neither a flat "
                             "state tensor of the partition nor a scalar")


def scalar_value(record: Mapping[str, Any]) -> Any:
    """The optimizer state a :func:`scalar_record` stands for (a fresh tensor, or the number)."""
    if record["dtype"] is None:
        return record["value"]
    return torch.tensor(record["value"], dtype=getattr(torch, record["dtype"]))


def parse_record(text: str, where: str) -> dict[str, Any]:
    """The record stored at :data:`RECORD_KEY` (its JSON text), refused when its format is not
    :data:`FORMAT`: a reader of another version's record would misread it silently."""
    record = json.loads(text)
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        found = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise StateMismatchError(f"{where}: DeepSpeed record format {found!r}, expected {FORMAT}")
    return record
