"""What a framework adapter's load checks on top of :func:`ckptkit.load`, shared by the DeepSpeed and Megatron adapters.

* **Unexpected tensors.** The adapters load with ``strict=False``: they derive some stored tensors
  rather than read them (DeepSpeed's training-dtype weights from the fp32 masters) and leave others
  (the optimizer's, on a weights-only load). Left at that, a checkpoint of a *changed* model (an
  extra layer, a bias the new config drops) loaded silently, its tensors and their Adam moments
  dropped; DeepSpeed's ``load_checkpoint`` (``load_module_strict=True``) and Megatron refuse it.
  :func:`refuse_unexpected` compares what the checkpoint holds with what the job's model would ask
  for, by model name, over every rank (a pipeline stage asks only for its own layers).
* **The adapter's record.** Its JSON record is the same on every rank by construction; a record
  the saving ranks disagreed about lands in the manifest's ``rank_values`` and is named here
  (:func:`record_text`) instead of being reported as "not a checkpoint of this adapter".
* **The user's value** (DeepSpeed's client state, Megatron's ``extra``): stored as a JSON string of
  its own, agreed when the ranks agree and per rank when they differ (a data loader's position), so
  that the core restores each rank's own at the saving world size and follows
  ``LoadOptions.per_rank_on_resize`` at another (:func:`user_value`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

from ckptkit.engine.collective import resolve_comm
from ckptkit.errors import MissingKeysError, StateMismatchError, UnexpectedKeysError
from ckptkit.layout.manifest import Manifest, dropped_per_rank_values
from ckptkit.layout.values import decode_value

log = logging.getLogger("ckptkit")

NOT_LOADED = ""
"""What a user value's slot holds until the load fills it; still there after a load at another world
size with ``per_rank_on_resize="skip"``, where a per-rank value has no rank to go to."""


def model_name(key: str) -> str:
    """The model tensor a stored tensor belongs to: ``model/<name>`` and ``optimizer/<state>/<name>``
    both belong to ``<name>``; any other key is its own."""
    if key.startswith("model/"):
        return key.removeprefix("model/")
    if key.startswith("optimizer/"):
        return key.split("/", 2)[-1]
    return key


def refuse_unexpected(stored: Iterable[str], requested: set[str], where: str, what: str,
                      ignored: Callable[[str], bool] = lambda key: False) -> None:
    """Raise UnexpectedKeysError on every rank when a stored tensor (not ``ignored``) belongs to a
    model name no rank's ``requested`` holds (collective: each rank passes its own model names).
    Its optimizer states go with a name, so a weights-only load does not report them."""
    keys = sorted(k for k in stored if not ignored(k))
    asked = resolve_comm().any_flags([model_name(k) in requested for k in keys])
    unexpected = [k for k, f in zip(keys, asked) if not f]
    if unexpected:
        shown = ", ".join(repr(k) for k in unexpected[:8])
        raise UnexpectedKeysError(
            f"{where}: {len(unexpected)} tensor(s) in the checkpoint are not in this {what}: {shown}"
            f"{' ...' if len(unexpected) > 8 else ''} (a changed model; pass strict=False to load without them)")


def record_text(manifest: Manifest, key: str, where: str, what: str) -> str:
    """The agreed JSON text of an adapter's record; a clear error naming the key and the differing
    fields when the saving ranks' records differed (the manifest then holds them per rank only)."""
    if key in manifest.values:
        return decode_value(manifest.values[key], f"{where}: {key}")
    groups = manifest.rank_values.get(key)
    if groups is None:
        raise MissingKeysError(f"{where}: not a checkpoint of ckptkit's {what} adapter (no {key!r} value)")
    fields: set[str] = set()
    try:
        records = [json.loads(decode_value(v, f"{where}: {key}")) for v, _ in groups]
        for name in {k for r in records for k in r}:
            if len({json.dumps(r.get(name), sort_keys=True) for r in records}) > 1:
                fields.add(name)
    except (ValueError, TypeError, AttributeError, StateMismatchError):
        fields = set()
    differs = f" (fields that differ: {', '.join(sorted(fields))})" if fields else ""
    raise StateMismatchError(
        f"{where}: the {what} record {key!r} differed between the saving ranks{differs}, so the manifest holds it "
        f"per rank ({len(groups)} versions, ranks {[list(r) for _, r in groups][:4]}) and no agreed record: "
        "this checkpoint cannot be loaded by the adapter")


def user_value(text: Any, key: str, where: str) -> dict[str, Any]:
    """The user's value from its loaded slot; ``{}`` with a warning naming the key where the load left
    the slot unfilled (a per-rank value at another world size, ``per_rank_on_resize="skip"``)."""
    if text == NOT_LOADED:
        log.warning("%s: %r was saved per rank (the saving ranks held different values) and this job has another "
                    "world size; per_rank_on_resize='skip': returning {} for it", where, key)
        return {}
    if not isinstance(text, str):
        raise StateMismatchError(f"{where}: {key!r} is a {type(text).__name__}, not the JSON text the adapter stores")
    value = json.loads(text)
    if not isinstance(value, dict):
        raise StateMismatchError(f"{where}: {key!r} holds a {type(value).__name__}, not a dict")
    return value


DROPPED = object()
"""What :func:`read_meta` of an adapter records for a user value its checkpoint lacks altogether."""


def dropped(manifest: Manifest, key: str) -> bool:
    """Whether ``ckptkit reshard`` dropped ``key``'s per-rank values (it records those it dropped, and
    those earlier reshards of its source did)."""
    return key in dropped_per_rank_values(manifest.meta)


def dropped_user_value(key: str, where: str, per_rank_on_resize: str) -> dict[str, Any]:
    """A user value (``client_state`` / ``extra``) the checkpoint holds neither agreed nor per rank: one
    that differed between the saving ranks, dropped by ``ckptkit reshard`` (per-rank values cannot follow
    their ranks into another layout). Refused naming it, or ``{}`` with a warning under
    ``per_rank_on_resize="skip"``, as a per-rank value at another world size is. Until 2026-12-06 the
    Megatron adapter returned ``{}`` without a word, the fields the ranks agreed on lost with it (a hunt)."""
    if per_rank_on_resize == "skip":
        log.warning("%s: %r is not in this checkpoint (its saving ranks held different values, and `ckptkit "
                    "reshard` drops per-rank values); per_rank_on_resize='skip': returning {} for it", where, key)
        return {}
    raise MissingKeysError(f"{where}: {key!r} is not in this checkpoint: the saving ranks held different values, "
                           "and `ckptkit reshard` drops per-rank values (they cannot follow their ranks into another "
                           "layout); pass LoadOptions(per_rank_on_resize='skip') to load without it")
