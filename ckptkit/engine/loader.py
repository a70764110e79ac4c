"""A load: manifest -> targets -> plan -> verified reads into the caller's tensors.

The reading itself (indexes, source matching, read plan, object checks, verified reads, tier
fallback) is the read engine's, :class:`~ckptkit.engine.read_session.ReadSession`, shared with
``open``, ``reshard`` and ``verify``; what is here is what only a load does: the caller's state as
targets, the collectives that keep ranks together, values and per-rank state.

Everything that can be checked from metadata is checked before the first
byte lands in a caller's tensor: keys, dtypes, global shapes, coverage,
index digests and object sizes. Only a checksum mismatch can be discovered
mid-way; the error then says the state may be partially overwritten.

A load needs no collective to plan or read: each rank reads the manifest and
the indexes of the ranks whose pieces it needs. With a process group, one
tiny all-reduce makes strict key checking global (a key no rank asked for is
unexpected) and makes every rank fail together.
"""

from __future__ import annotations

import base64
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptkit.engine.dtensor_grid import grid_of, is_dtensor, local_of
from ckptkit.engine.collective import Comm, failed_ranks
from ckptkit.engine.load_progress import LoadProgress, ProgressRecord, WatchedComm
from ckptkit.engine.overlap import pass_pending_gates
from ckptkit.engine.read_once import read_once
from ckptkit.engine.read_session import ReadSession
from ckptkit.engine.shared_targets import SharedTargets, is_staged, is_wrapper, share_targets
from ckptkit.engine.state import FlatState, dtype_name, not_dense_memory
from ckptkit.engine.watchdog import supervise
from ckptkit.errors import (
    CorruptCheckpointError,
    DTypeMismatchError,
    MissingKeysError,
    PeerFailureError,
    ShapeMismatchError,
    StateMismatchError,
    UnexpectedKeysError,
)
from ckptkit.layout.box import Box, Region
from ckptkit.layout.index import Index
from ckptkit.layout.manifest import Manifest
from ckptkit.layout.pieces import LocalBox
from ckptkit.layout.values import decode_value, shaped_like
from ckptkit.options import LoadOptions
from ckptkit.plan.load_plan import CopyOp, Target
from ckptkit.storage.base import ByteStore

log = logging.getLogger("ckptkit")


@dataclass(frozen=True)
class LoadResult:
    path: str
    bytes_read: int
    seconds: float
    meta: dict[str, Any] = field(default_factory=dict)
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    progress: LoadProgress | None = None  # this rank's, at the end (bytes read, pieces placed)


@dataclass
class _Dest:
    """A tensor being filled: the caller's, or a contiguous CPU stand-in copied back at the end."""

    user: torch.Tensor
    work: torch.Tensor

    def finish(self) -> None:
        if is_staged(self.user, self.work):
            with torch.no_grad():
                self.user.copy_(self.work)


def _alias(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors of a state the same memory, seen the same way (tied weights: one
    Parameter under two keys; Sharded declarations over one local tensor), or None for an empty one
    (they share no element)."""
    if not t.numel():
        return None
    if is_wrapper(t):
        return ("wrapper", id(t))
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype,
            t.is_conj(), t.is_neg())


def _check_dest(t: torch.Tensor, key: str, where: str) -> None:
    """Refuse, naming it, a tensor of the state that cannot take a checkpoint's values (before anything
    is read, and before its shape is asked: a nested tensor has none)."""
    why = not_dense_memory(t)
    # a zero-size tensor shares no element whatever its strides (torch gives some of them stride 0)
    if why is None and t.numel() and any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride())):
        why = "an expanded view whose elements share memory (load into a tensor of its own, then expand it)"
    if why is not None:
        raise StateMismatchError(f"{where}: tensor {key!r} of the state cannot be loaded into: it is {why}")


def _dest(t: torch.Tensor) -> _Dest:
    """Where ``t``'s bytes are read to: ``t`` itself when its memory holds its elements as they are,
    else a contiguous CPU stand-in that :meth:`_Dest.finish` copies back (a GPU tensor, a strided
    view, a conjugate or negative view, whose memory holds other values than it shows)."""
    if is_wrapper(t):  # its values live in tensors it wraps: read into a plain one, copied in through t's copy_
        work = torch.empty(tuple(t.shape), dtype=t.dtype)
        with torch.no_grad():
            work.copy_(t)
        return _Dest(t, work)
    if t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
        return _Dest(t, t.detach())
    return _Dest(t, t.detach().to("cpu", copy=True).resolve_conj().resolve_neg().contiguous())


def _check_meta(manifest: Manifest, key: str, dtype: torch.dtype, shape: tuple[int, ...], where: str) -> None:
    meta = manifest.tensors[key]
    if meta.dtype != dtype_name(dtype):
        raise DTypeMismatchError(f"{where}: tensor {key!r} is {meta.dtype} in the checkpoint, the state expects {dtype_name(dtype)}")
    if meta.shape != tuple(shape):
        raise ShapeMismatchError(
            f"{where}: tensor {key!r} has global shape {list(meta.shape)} in the checkpoint, the state expects {list(shape)}"
        )


@dataclass
class _Plan:
    targets: list[Target] = field(default_factory=list)
    dests: list[_Dest] = field(default_factory=list)
    requested: set[str] = field(default_factory=set)
    missing: list[str] = field(default_factory=list)
    seen: dict[tuple[Any, ...], int] = field(default_factory=dict)
    shared: SharedTargets | None = None

    def add(self, t: torch.Tensor) -> int:
        """The destination for tensor ``t``; its index. A tensor an earlier key already named (tied
        weights, Sharded declarations over one local tensor) is one destination, filled once and
        copied back once; :mod:`ckptkit.engine.shared_targets` checks the pieces that meet."""
        alias = _alias(t)
        if alias is not None and alias in self.seen:
            return self.seen[alias]
        self.dests.append(_dest(t))
        if alias is not None:
            self.seen[alias] = len(self.dests) - 1
        return len(self.dests) - 1


def _targets(flat: FlatState, manifest: Manifest, strict: bool, where: str) -> _Plan:
    plan = _Plan()
    for leaf in flat.tensors:
        t = leaf.obj
        plan.requested.add(leaf.key)
        if leaf.key not in manifest.tensors:
            plan.missing.append(leaf.key)
            continue
        _check_dest(local_of(t) if is_dtensor(t) else t, leaf.key, where)
        _check_meta(manifest, leaf.key, t.dtype, tuple(t.shape), where)
        if is_dtensor(t):
            layout, coord = grid_of(t, leaf.key)
            held = layout.local_pieces(coord)
            local = local_of(t)
            if held is None:
                continue
            ref = plan.add(local)
            for lo, box in held[1]:
                if not box.is_empty():
                    plan.targets.append(Target(ref, leaf.key, Region(box), tuple(local.shape), LocalBox(lo)))
        else:
            ref = plan.add(t)
            if t.numel():
                plan.targets.append(Target(ref, leaf.key, Region(Box.full(tuple(t.shape))), tuple(t.shape), LocalBox(tuple(0 for _ in t.shape))))
    for leaf in flat.sharded:
        s = leaf.obj
        _check_dest(s.local, leaf.key, where)
        ref = plan.add(s.local)
        for p in s.pieces:
            plan.requested.add(p.tensor)
            if p.tensor not in manifest.tensors:
                plan.missing.append(p.tensor)
                continue
            _check_meta(manifest, p.tensor, s.local.dtype, p.shape, where)
            if p.numel:
                plan.targets.append(Target(ref, p.tensor, p.region, tuple(s.local.shape), p.local))
    plain = len(flat.values)
    for i, leaf in enumerate((*flat.values, *flat.generators, *flat.per_rank)):
        plan.requested.add(leaf.key)
        _check_value_kind(manifest, leaf.key, i < plain, where)
        if leaf.key not in manifest.values and leaf.key not in manifest.per_rank_keys \
                and leaf.key not in manifest.rank_values:
            plan.missing.append(leaf.key)
    if plan.missing and strict:
        shown = ", ".join(_held_as(manifest, k) for k in sorted(plan.missing)[:8])
        raise MissingKeysError(
            f"{where}: {len(plan.missing)} key(s) of the state are not in the checkpoint: {shown}"
            f"{' ...' if len(plan.missing) > 8 else ''} (pass strict=False to load the rest)"
        )
    plan.shared = share_targets([d.user for d in plan.dests], [d.work for d in plan.dests], plan.targets)
    return plan


def _check_value_kind(manifest: Manifest, key: str, plain: bool, where: str) -> None:
    """A plain value of the state must be a value the saving ranks held (agreed or not), a ``PerRank``
    or generator must be one stored per rank: loading one kind into the other used to succeed, strict,
    and leave the state's value as it was, without a word."""
    if plain and key in manifest.per_rank_keys and key not in manifest.values and key not in manifest.rank_values:
        raise StateMismatchError(f"{where}: {key!r} is a per-rank value in the checkpoint (ckptkit.PerRank or a "
                                 f"torch.Generator), the state holds a plain value there: wrap it in ckptkit.PerRank, "
                                 f"or pass a torch.Generator")
    if not plain and key not in manifest.per_rank_keys and (key in manifest.values or key in manifest.rank_values):
        raise StateMismatchError(f"{where}: {key!r} is a plain value in the checkpoint, the state holds a per-rank "
                                 f"value there (ckptkit.PerRank or a torch.Generator): pass the plain value")


def _held_as(manifest: Manifest, key: str) -> str:
    """A missing key, and what the checkpoint holds under that name instead, if anything (a tensor
    where the state has a value, a dict where it has a leaf), so the error says what differs."""
    if key in manifest.tensors:
        return f"{key!r} (a tensor in the checkpoint)"
    if key in manifest.values or key in manifest.rank_values or key in manifest.per_rank_keys:
        return f"{key!r} (a value in the checkpoint)"
    prefix = key + "/"
    if any(k.startswith(prefix) for k in (*manifest.tensors, *manifest.values, *manifest.per_rank_keys)):
        return f"{key!r} (a dict or list in the checkpoint, keys {prefix}...)"
    parts = key.split("/")
    for n in range(len(parts) - 1, 0, -1):
        above = "/".join(parts[:n])
        if above in manifest.tensors or above in manifest.values or above in manifest.rank_values:
            return f"{key!r} (the checkpoint holds one {'tensor' if above in manifest.tensors else 'value'} at {above!r})"
    return repr(key)


def _all_keys(manifest: Manifest) -> list[str]:
    return sorted({*manifest.tensors, *manifest.values, *manifest.per_rank_keys, *manifest.rank_values})


#: the attribute :func:`load_state` sets on an exception it raises once reading into the state began
_OVERWROTE = "ckptkit_state_overwritten"


def overwrote_state(exc: BaseException) -> bool:
    """Whether the failed load that raised ``exc`` had begun writing into the caller's tensors (a
    checksum mismatch found mid-read, a rank lost mid-read): they may then hold part of the
    checkpoint. A failure found before (keys, shapes, metadata, index damage) left them untouched."""
    return bool(getattr(exc, _OVERWROTE, False))


def load_state(
    flat: FlatState,
    store: ByteStore,
    comm: Comm,
    *,
    strict: bool = True,
    options: LoadOptions = LoadOptions(),
) -> LoadResult:
    """Load ``flat`` from ``store``; collective over ``comm``.

    Under the load watchdog (``options.stall_seconds``, :mod:`ckptkit.engine.watchdog`) the load
    runs on a worker thread while this one watches its progress, so a read that never returns
    fails the load on every rank, naming the rank and the object, instead of hanging the job."""
    pass_pending_gates()  # an overlapped save of this state copies it first (our writes move no version)
    record = ProgressRecord(comm.rank)
    try:
        return supervise(lambda: _load(flat, store, WatchedComm(comm, record), strict, options, record), record,
                         where=store.url, comm=comm, stall_seconds=options.stall_seconds, on_progress=options.on_progress)
    finally:
        _moved(flat)


def _moved(flat: FlatState) -> None:
    """Tell torch that every destination tensor may have changed: the reads land through memoryviews, behind
    its version counters (autograd's saved-tensor checks and an overlapped snapshot's race checks read them).
    A DTensor's own counter moves too: an in-place change of one moves that, not its local tensor's."""
    for obj in flat.tensor_objects():
        for t in (obj, local_of(obj)) if is_dtensor(obj) else (obj,):
            try:
                torch.autograd.graph.increment_version(t)
            except RuntimeError:  # an inference tensor keeps no version
                pass


def _load(flat: FlatState, store: ByteStore, comm: Comm, strict: bool, options: LoadOptions,
          record: ProgressRecord) -> LoadResult:
    t0 = time.perf_counter()
    where = store.url
    error: BaseException | None = None
    manifest: Manifest | None = None
    plan = _Plan()
    ops: list[CopyOp] = []
    session: ReadSession | None = None
    try:
        session = ReadSession(store, io_threads=options.io_threads, progress=record)
        manifest = session.manifest
        record.phase("planning")
        plan = _targets(flat, manifest, strict, where)
        if manifest.world_size == comm.world_size:
            _check_own_split_values(flat, manifest, comm.rank, where, None if strict else plan.missing)
        elif options.per_rank_on_resize == "error":  # inside the agreement: only some ranks may hold them
            _refuse_per_rank_on_resize(flat, manifest, comm.world_size, where)
        assert plan.shared is not None
        ops = session.match(plan.shared.targets)
    except Exception as exc:  # carried through the collective below, then re-raised
        error = exc
    # Every rank enters the same collectives whatever happened, so no rank waits forever.
    if comm.any_flags([error is not None])[0]:
        said = comm.all_gather_json(_said(error))  # only when one failed: every rank learns which, and why
        if error is not None:
            raise error
        raise PeerFailureError(f"loading {where} failed on another rank: {failed_ranks(said)}")
    assert manifest is not None and session is not None
    keys = _all_keys(manifest)
    requested = comm.any_flags([k in plan.requested for k in keys])
    unexpected = [k for k, f in zip(keys, requested) if not f]
    if unexpected and strict:
        shown = ", ".join(repr(k) for k in unexpected[:8])
        raise UnexpectedKeysError(
            f"{where}: {len(unexpected)} key(s) in the checkpoint are not in any rank's state: {shown}"
            f"{' ...' if len(unexpected) > 8 else ''} (pass strict=False to ignore them)"
        )

    per_rank_needed = bool(flat.generators or flat.per_rank)
    resized = manifest.world_size != comm.world_size
    own = {comm.rank} if per_rank_needed and not resized else set()
    nbytes, error, reading = _read_into_state(session, ops, own, plan, flat, comm, options, resized, strict)
    record.phase("agreement")
    try:
        outcomes = _agree(comm, error, time.perf_counter() - t0, nbytes, where)
    except BaseException as exc:
        if reading:  # bytes may have landed in this rank's tensors before the load failed here or elsewhere
            setattr(exc, _OVERWROTE, True)
        raise
    record.finish()
    seconds = time.perf_counter() - t0
    log.info(
        "loaded %s: %.3f GiB on rank %d in %.2fs (%.2f GiB/s)",
        where, nbytes / 2**30, comm.rank, seconds, nbytes / 2**30 / max(seconds, 1e-9),
    )
    if comm.rank == 0 and len(outcomes) > 1:
        _log_skew(where, outcomes)
    return LoadResult(where, nbytes, seconds, dict(manifest.meta), tuple(sorted(plan.missing)), tuple(unexpected),
                      record.snapshot())


def _read_into_state(session: ReadSession, ops: list[CopyOp], own: set[int], plan: _Plan, flat: FlatState,
                     comm: Comm, options: LoadOptions, resized: bool,
                     strict: bool) -> tuple[int, BaseException | None, bool]:
    """Plan the reads, read (once per job when ranks share bytes), place, assign values. Returns the
    bytes this rank read from storage, its error, if any (not raised: the caller agrees on it), and
    whether reading into this rank's tensors began (from then on a failure leaves them partly
    overwritten). Collective when reading once: every rank enters it whatever failed before."""
    where = session.url
    manifest = session.manifest
    shared = plan.shared
    assert shared is not None
    works = [d.work for d in plan.dests]
    targets = works + shared.buffers
    nbytes = 0
    reading = False
    read_plan = None
    error: BaseException | None = None
    try:
        read_plan = session.plan(ops, extra_ranks=own)  # reads the writers' indexes: may find damage
        if own and not resized:
            _check_own_per_rank(flat, session.indexes(own).get(comm.rank), where, comm.rank,
                                None if strict else plan.missing)
    except Exception as exc:  # noqa: BLE001 - carried through the collective below, then re-raised
        error, read_plan = exc, None
    if comm.world_size > 1 and comm.any_flags([error is not None])[0]:
        # every rank's reads are planned (its writers' indexes read and checked) before any rank reads into
        # a tensor: an index only one rank needs, found damaged there, let the others read into theirs, or
        # marked them as having begun, and "partly overwritten" replaced "nothing restored" (a hunt, 2026-12-06)
        said = comm.all_gather_json(_said(error))
        if error is None:
            error = PeerFailureError(f"loading {where} failed on another rank before anything was read: "
                                     f"{failed_ranks(said)}")
        return 0, error, False
    assert session.progress is not None
    session.progress.phase("reading")
    try:
        if options.read_once and comm.world_size > 1 and hasattr(comm, "group"):
            reading = read_plan is not None
            nbytes, received = read_once(session, read_plan, targets, comm)  # collective, whatever failed
            if received:
                log.debug("%s: rank %d received %.3f GiB from the ranks that read it", where, comm.rank,
                          received / 2**30)
        elif read_plan is not None:
            reading = True
            nbytes = session.execute(read_plan, targets)
        if error is not None:
            raise error
        session.progress.phase("values")
        indexes = session.indexes(own)
        shared.place(works)
        filled = {t.ref for t in shared.original}
        for ref, d in enumerate(plan.dests):
            if ref in shared.piecewise:
                shared.copy_back(ref, d.user, d.work)
            elif ref in filled:  # a destination nothing was read into keeps its memory as it is
                d.finish()
        shared.check([d.user for d in plan.dests], works, where)
        _assign_values(flat, manifest, indexes.get(comm.rank) if not resized else None, where,
                       None if resized else comm.rank)
    except CorruptCheckpointError as exc:
        error = CorruptCheckpointError(f"{exc} (the state may be partially overwritten; load another checkpoint)") \
            if reading else exc
    except Exception as exc:  # noqa: BLE001 - carried through the collective below, then re-raised
        error = exc
    return nbytes, error, reading


def _agree(comm: Comm, error: BaseException | None, seconds: float, nbytes: int, where: str) -> list[Any]:
    """Every rank's (failed, seconds, bytes read); raise on every rank if any failed.

    A damaged piece fails only the ranks that read it: every rank learns of it, so a load succeeds
    on every rank or on none (a rank that went on would wait forever in the trainer's next
    collective). The times come along because the skew between ranks is what trips a job's
    collective timeouts at scale, so every load states it."""
    try:
        outcomes = comm.all_gather_json((_said(error), seconds, nbytes))
    except RuntimeError as exc:  # a rank died mid-load: its connections are gone
        raise PeerFailureError(f"loading {where}: another rank stopped answering ({exc}); the state may be "
                               "partially overwritten") from (error or exc)
    if any(said is not None for said, _, _ in outcomes):
        if error is not None:
            raise error
        raise PeerFailureError(f"loading {where} failed on another rank (the state may be partially "
                               f"overwritten; load another checkpoint): {failed_ranks([o[0] for o in outcomes])}")
    return outcomes


def _said(error: BaseException | None) -> str | None:
    """What a rank's error says, for the other ranks' messages: JSON-safe text, at most 400 characters."""
    if error is None:
        return None
    text = f"{type(error).__name__}: {error}".encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= 400 else text[:397] + "..."


def _log_skew(where: str, outcomes: list[Any]) -> None:
    times = sorted(t for _, t, _ in outcomes)
    slowest = max(range(len(outcomes)), key=lambda r: outcomes[r][1])
    log.info("loaded %s on %d ranks: %.2fs to %.2fs per rank (median %.2fs, skew %.2fs, slowest rank %d); "
             "%.3f GiB read from storage in all", where, len(times), times[0], times[-1], times[len(times) // 2],
             times[-1] - times[0], slowest, sum(n for _, _, n in outcomes) / 2**30)


def _refuse_per_rank_on_resize(flat: FlatState, manifest: Manifest, world_size: int, where: str) -> None:
    """``per_rank_on_resize="error"`` at another world size: this rank's per-rank values, generators and
    values the saving ranks disagreed on cannot be matched to ranks. Raised before the load's first
    agreement, so every rank learns it: a pipeline stage holding none of them went on into the reads
    while the stage that did raised alone, and the load (every rank, under ``restore_latest``) hung
    (found by a hunt, 2026-12-06)."""
    keys = [leaf.key for leaf in (*flat.generators, *flat.per_rank)]
    keys += [leaf.key for leaf in flat.values if leaf.key in manifest.rank_values]
    if keys:
        raise StateMismatchError(
            f"{where}: the checkpoint was saved by {manifest.world_size} ranks, this job has {world_size}; "
            f"per-rank values {keys[:4]} cannot be matched to ranks (LoadOptions(per_rank_on_resize='skip') keeps "
            "the current ones)")


def _check_own_split_values(flat: FlatState, manifest: Manifest, rank: int, where: str,
                            missing: list[str] | None) -> None:
    """A value the saving ranks disagreed about is restored to the rank that held it; a rank that
    asks for one it did not hold is told so before anything is read (with every rank failing), or,
    not strict (``missing`` given), keeps its own with the key listed as missing (it failed the load
    whatever ``strict`` said until 2026-12-06)."""
    for leaf in flat.values:
        groups = manifest.rank_values.get(leaf.key)
        if groups is not None and not any(rank in ranks for _, ranks in groups):
            if missing is None:
                raise MissingKeysError(f"{where}: value {leaf.key!r} was saved per rank (the saving ranks held "
                                       f"different values) and rank {rank} held none (pass strict=False to keep "
                                       "this rank's own)")
            if leaf.key not in missing:
                missing.append(leaf.key)


def _check_own_per_rank(flat: FlatState, own_index: Index | None, where: str, rank: int,
                        missing: list[str] | None) -> None:
    """Before any byte is read: a per-rank value or generator this rank did not save, though another
    rank did, is added to ``missing`` (a non-strict load), or :class:`MissingKeysError` (``missing``
    None: strict). Until 2026-12-06 it kept the state's own without a word, even under ``strict=True``."""
    held = {} if own_index is None else own_index.values
    absent = [leaf.key for leaf in (*flat.generators, *flat.per_rank) if leaf.key not in held]
    if absent and missing is None:
        raise MissingKeysError(f"{where}: per-rank value(s) {', '.join(repr(k) for k in absent[:8])} were saved by "
                               f"other ranks, not by rank {rank} (pass strict=False to keep this rank's own)")
    if missing is not None:
        missing.extend(k for k in absent if k not in missing)


def _assign_values(flat: FlatState, manifest: Manifest, own_index: Index | None, where: str,
                   rank: int | None) -> None:
    """Values into the state: agreed ones on every rank; values the saving ranks disagreed about,
    and per-rank values, only to the same rank of a same-size job (``rank``/``own_index`` None on a
    resize, where ``per_rank_on_resize`` already refused or chose to keep the state's own)."""
    for leaf in flat.values:
        if leaf.key in manifest.values:
            flat.assign(leaf, decode_value(manifest.values[leaf.key], f"{where}: value {leaf.key!r}"))
        elif leaf.key in manifest.rank_values and rank is not None:
            for encoded, ranks in manifest.rank_values[leaf.key]:
                if rank in ranks:
                    flat.assign(leaf, decode_value(encoded, f"{where}: value {leaf.key!r} of rank {rank}"))
                    break
            # else: none for this rank, which keeps its own (checked before the reads, listed as missing)
    if own_index is None:
        return
    for leaf in flat.generators:
        if leaf.key in own_index.values:
            leaf.obj.set_state(_generator_state(own_index.values[leaf.key], leaf.key, where, rank, leaf.obj.device))
    for leaf in flat.per_rank:
        if leaf.key in own_index.values:
            encoded = own_index.values[leaf.key]
            if _is_generator(encoded):
                raise StateMismatchError(f"{where}: {leaf.key!r} is a torch.Generator's state in the checkpoint, "
                                         f"the state holds a ckptkit.PerRank there: pass a torch.Generator")
            leaf.obj.value = shaped_like(decode_value(encoded, f"{where}: value {leaf.key!r}"), leaf.obj.value)


def _is_generator(encoded: Any) -> bool:
    """Whether a per-rank entry is a generator's state: no PerRank value encodes to this form
    (``__generator__`` is one of the value tags, so a dict with that key is stored tagged)."""
    return isinstance(encoded, dict) and set(encoded) == {"__generator__"}


def _generator_state(encoded: Any, key: str, where: str, rank: int | None,
                     device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """A saved ``torch.Generator`` state, checked before torch sees it (torch raises a bare
    RuntimeError, or worse, on a malformed state) on a scratch generator of the target's device: a
    CUDA generator's state is 16 bytes, a CPU one's 5,056 (a CPU probe called every CUDA
    generator's state corrupt)."""
    what = f"{where}: per-rank value {key!r} of rank {rank}"
    if not _is_generator(encoded):
        raise StateMismatchError(f"{what} is a ckptkit.PerRank value in the checkpoint, not a generator's state; "
                                 f"the state holds a torch.Generator there: pass a ckptkit.PerRank")
    if not isinstance(encoded["__generator__"], str):
        raise CorruptCheckpointError(f"{what} is not a generator state")
    try:
        raw = base64.b64decode(encoded["__generator__"], validate=True)
    except ValueError:
        raise CorruptCheckpointError(f"{what}: malformed base64") from None
    state = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    try:
        torch.Generator(device=device).set_state(state)
    except (RuntimeError, ValueError, TypeError) as exc:
        for other in ("cpu", "cuda"):
            if other != device.type and _fits(state, other):
                raise StateMismatchError(f"{what} is a {other} generator's state; the state holds a {device.type} "
                                         f"generator there") from None
        raise CorruptCheckpointError(f"{what}: not a valid generator state ({len(raw)} bytes): {exc}") from None
    return state


def _fits(state: torch.Tensor, device: str) -> bool:
    """Whether ``state`` is a valid state for a generator on ``device`` (False where there is none)."""
    try:
        torch.Generator(device=device).set_state(state)
    except (RuntimeError, ValueError, TypeError):
        return False
    return True
