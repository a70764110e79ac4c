"""The torchtitan manager's agreements with ckptkit's engine: which checkpoint keys a partial load
may leave unread and what a resize does with values the saving ranks disagreed on (how one rank's
failed save preparation reaches every rank is :func:`ckptkit.engine.collective.agreed_preparation`,
shared with the DeepSpeed and Megatron adapters). Kept apart from :mod:`ckptkit.adapters.torchtitan`, which
wires torchtitan's objects; everything here is collective where it says so, entered by every rank."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ckptkit.engine.collective import Comm, every_rank_does
from ckptkit.engine.state import flatten_state
from ckptkit.errors import MissingKeysError, StateMismatchError, UnexpectedKeysError
from ckptkit.layout.manifest import Manifest
from ckptkit.layout.values import decode_value, join_key

log = logging.getLogger("ckptkit")


def _under(key: str, prefixes: Iterable[str]) -> bool:
    return any(key == p or key.startswith(p + "/") for p in prefixes)


def check_keys(comm: Comm, manifest: Manifest, state: Mapping[str, Any], path: str, *,
               excluded: Iterable[str], only: str | None) -> None:
    """What ``strict`` checks, for a load that leaves entries out on purpose. Collective.

    ``excluded``: top-level entries not loaded (``exclude_from_loading``); ``only``: the one entry a
    model-only load reads (every other entry of the checkpoint is left unread). Every key of ``state``
    must be in the checkpoint, and every key of the checkpoint must be asked for by some rank unless it
    is under a left-out entry: a partial load used to turn the unexpected-key check off altogether,
    so a checkpoint of a larger model loaded into a smaller one without a word. Keys are agreed over
    every rank (a pipeline stage asks only for its own), so all ranks raise or none does."""
    have = sorted({*manifest.tensors, *manifest.values, *manifest.per_rank_keys, *manifest.rank_values})
    flat = flatten_state(dict(state))
    asked = {leaf.key for group in (flat.tensors, flat.values, flat.generators, flat.per_rank) for leaf in group}
    asked |= {p.tensor for leaf in flat.sharded for p in leaf.obj.pieces}
    missing = sorted(asked.difference(have))
    flags = comm.any_flags([k in asked for k in have] + [bool(missing)])
    if missing:
        raise MissingKeysError(f"{path}: {len(missing)} key(s) of the state are not in the checkpoint: "
                               f"{', '.join(repr(k) for k in missing[:8])}")
    if flags[-1]:
        raise MissingKeysError(f"{path}: key(s) of another rank's state are not in the checkpoint (that rank names them)")
    left_out = [join_key((name,)) for name in excluded]
    unexpected = [k for k, f in zip(have, flags) if not f and not _under(k, left_out)
                  and not (only is not None and not _under(k, [only]))]
    if unexpected:
        raise UnexpectedKeysError(
            f"{path}: {len(unexpected)} key(s) in the checkpoint are not in any rank's state and not under an "
            f"excluded entry ({', '.join(left_out) or 'none'}): {', '.join(repr(k) for k in unexpected[:8])}"
            f"{' ...' if len(unexpected) > 8 else ''}")


def take_rank0_values(comm: Comm, manifest: Manifest, state: dict[str, Any], path: str) -> list[str]:
    """On a resize, values the saving ranks disagreed on (a per-rank counter in ``train_state``) get
    saving rank 0's value, as torchtitan's own manager restores rank 0's ``train_state`` on every rank.
    The engine keeps the state's current values there (``per_rank_on_resize="skip"``, which the
    data-loader record needs), so without this they silently stayed the fresh job's. A key that rank 0
    did not hold (saved by other ranks only, with values that differ) has no such value: refused on
    every rank, named. Generator states are per rank with no mapping between world sizes: they keep
    the new job's (logged). Collective (:func:`every_rank_does`); returns the keys taken from rank 0."""
    if manifest.world_size == comm.world_size:
        return []
    flat = flatten_state(state)

    def take() -> tuple[list[str], None]:
        taken = []
        for leaf in flat.values:
            groups = manifest.rank_values.get(leaf.key)
            if groups is None:
                continue
            value = next((encoded for encoded, ranks in groups if 0 in ranks), None)
            if value is None:
                raise StateMismatchError(
                    f"{path}: {leaf.key!r} was saved per rank (the saving ranks held different values) and saving "
                    f"rank 0 held none, so there is no rank 0 value to restore at {comm.world_size} ranks (saved by "
                    f"{manifest.world_size}); exclude its entry from loading, or resume at {manifest.world_size} ranks")
            flat.assign(leaf, decode_value(value, f"{path}: value {leaf.key!r} of rank 0"))
            taken.append(leaf.key)
        return taken, None

    taken, _, failed = every_rank_does(comm, take, "restoring rank 0's values")
    if failed is not None:
        raise StateMismatchError(f"{path}: restoring the values the saving ranks disagreed on failed on {failed}")
    if comm.rank == 0 and taken:
        log.warning("%s was saved by %d ranks, loaded by %d: the saving ranks held different values of %s; every "
                    "rank now holds saving rank 0's", path, manifest.world_size, comm.world_size, ", ".join(taken[:8]))
    if comm.rank == 0 and flat.generators:
        log.warning("%s was saved by %d ranks, loaded by %d: generator states %s are per rank and keep this job's",
                    path, manifest.world_size, comm.world_size, ", ".join(leaf.key for leaf in flat.generators[:8]))
    return taken

