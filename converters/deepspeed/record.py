"""The adapter's ``deepspeed`` record, as the converters write it from native files and read it back.

The record is built by the one builder the live adapter uses too
(:func:`ckptkit.adapters.deepspeed_record.build_record`): what is read here is only what a native
folder holds in its own way — counters that DeepSpeed writes into the model-states file (checked
here, since a damaged file may hold anything), the alias map ``shared_params``, and the client
state, which DeepSpeed merges into the same dict as its own keys.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ckptkit.adapters.deepspeed_record import (
    CLIENT_KEY,
    CLIENT_STATE,
    RECORD_KEY,
    Counters,
    FrameworkState,
    RecordSources,
    SavedLayout,
    build_record,
    client_state_record,
    ds_config_record,
    parse_record,
)
from ckptkit.errors import ManifestError
from ckptkit_converters.deepspeed import files as fmt

META_KEY = RECORD_KEY
"""Where the record sits among a ckptkit checkpoint's values."""


def read_meta(view: Any) -> dict[str, Any]:
    """The record of the ckptkit checkpoint open in ``view`` (a :func:`ckptkit.open` view), refused when
    the checkpoint is not one of the DeepSpeed adapter's or its record is of another format version."""
    values = view.values
    if META_KEY not in values:
        raise ManifestError(f"{view.url}: not a checkpoint of ckptkit's DeepSpeed adapter (no {META_KEY!r})")
    record = parse_record(values[META_KEY], view.url)
    if CLIENT_STATE not in record:  # a live save keeps it apart: rank 0's, as DeepSpeed's rank 0 writes it
        record[CLIENT_STATE] = json.loads(view.values_of(0).get(CLIENT_KEY, "{}"))
    return record


def native_count(record: Mapping[str, Any], key: str, where: str, default: int, minimum: int = 0) -> int:
    """An integer counter of a native record (``global_steps`` ...), refused by name when it is not one."""
    value = record.get(key, default)
    value = default if value is None else value
    if type(value) is not int or value < minimum:
        raise ManifestError(f"{where}: {key} is {value!r}; expected an integer >= {minimum}")
    return value


def shared_params(model0: Mapping[str, Any], where: str) -> dict[str, str]:
    """The tied-parameter aliases of a model-states file (``shared_params``: alias -> parameter name),
    kept as they are or refused by name."""
    mapping = model0.get("shared_params") or {}
    if not isinstance(mapping, Mapping) or not all(isinstance(a, str) and isinstance(b, str)
                                                   for a, b in mapping.items()):
        raise ManifestError(f"{where}: shared_params is not a map of parameter names to parameter names")
    return dict(mapping)


def native_record(model0: Mapping[str, Any], layout: SavedLayout, param_groups: Sequence[Mapping[str, Any]],
                  sources: RecordSources) -> tuple[dict[str, Any], list[str]]:
    """The adapter's record of an imported native checkpoint whose model-states file holds ``model0``,
    and the client-state keys left out for not being JSON-representable (listed in the result, never
    stored as strings). ``micro_steps`` is ``global_steps × gradient_accumulation_steps``: a native
    folder keeps no micro-step counter, and a resume sets it that way too."""
    where = sources.model_states
    config = model0.get("ds_config") or {}
    ds_config_record(config, where)  # a dict (refused otherwise) before its counters are read
    gas = native_count(config, "gradient_accumulation_steps", f"{where}: ds_config", 1, minimum=1)
    steps = native_count(model0, "global_steps", where, 0)
    counters = Counters(steps, native_count(model0, "global_samples", where, 0),
                        native_count(model0, "skipped_steps", where, 0), steps * gas, gas)
    kept, refused = client_state_record({k: v for k, v in model0.items() if k not in fmt.DEEPSPEED_KEYS}, where)
    state = FrameworkState(param_groups, model0.get("lr_scheduler"), config, kept, sources)
    return build_record(layout, counters, state), list(refused)
