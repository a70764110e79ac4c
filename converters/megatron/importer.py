"""Megatron-core checkpoints into ckptkit (model weights).

* :func:`import_torch_dist`: a ``torch_dist`` directory (DCP + ``metadata.json``
  + ``common.pt``) -> a committed ckptkit checkpoint in model space: every
  DCP chunk becomes a piece written by the virtual rank whose ``.distcp`` file
  held it (no gather), vocab padding rows dropped, a :class:`PartitionRule`
  per tensor (:mod:`ckptkit_converters.megatron.names`), and ``megatron/meta``.
* :func:`import_legacy` (:mod:`ckptkit_converters.megatron.legacy`, re-exported here): a legacy
  ``iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt`` checkpoint -> the same.
* :func:`ckptkit_converters.megatron.exporter.export_torch_dist`: the way back, a ckptkit
  Megatron checkpoint -> a ``torch_dist`` directory for a chosen ``tp``/``pp``.

Facts the checkpoint records about itself are read from its Megatron-LM ``args``
(:class:`ckptkit_converters.megatron.files.SavedArgs`: ``vocab_size`` when the run was given
``--vocab-size``, ``make_vocab_size_divisible_by``, ``padded_vocab_size``, ``num_layers``,
parallel sizes, tied embeddings); only what they do not say is asked for
(:func:`resolve_vocab`, naming it).

Optimizer state: what Megatron saves in model space, ``optimizer.state.<state>.<key>`` — the plain
optimizers' (``exp_avg``, ``exp_avg_sq``, ``fp32_param``) and the distributed optimizer's in its
``fully_reshardable`` form (``param`` for the main copies) — is imported as
``optimizer/{exp_avg,exp_avg_sq,main}/<key>``, with the record the live adapter resumes it from (step,
hyper-parameters; :mod:`ckptkit_converters.megatron.optimizer_record`) and the LR scheduler's state. So is the
distributed optimizer's state in Megatron-LM's default ``dp_reshardable`` buckets, placed in model space by
:mod:`ckptkit_converters.megatron.optimizer_buckets`. Non-tensor items other than the optimizer's
(RNG, and ``_extra_state`` in a form other than Transformer Engine 2.x's payload) are listed in
``skipped``; TE's FP8 payloads are imported by :mod:`.extra_states`. Every pickle is opened as
:mod:`ckptkit_converters.megatron.files` says.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptkit.errors import CheckpointNotFoundError, ManifestError
from ckptkit.layout.box import Box, Region
from ckptkit.layout.strict_json import MAX_METADATA_BYTES
from ckptkit.engine.offline_writer import StoredTensor
from ckptkit.options import Progress
from ckptkit.storage.local import LocalStore
from ckptkit.storage.url import open_store
from ckptkit_converters.common.source_paths import regular_file
from ckptkit_converters.dcp.convert import data_files
from ckptkit_converters.dcp.files import (
    METADATA_NAME,
    DcpCheckpoint,
    parse_metadata,
)
from ckptkit_converters.megatron import files as fmt
from ckptkit_converters.megatron import extra_states, names, optimizer_buckets, optimizer_record
from ckptkit_converters.megatron.optimizer_buckets import BucketPieces
from ckptkit_converters.megatron.files import MODEL, MegatronConvertResult
from ckptkit_converters.megatron.import_shared import (
    ImportRun,
    RankPieces,
    check_layer_count,
    check_vocab_rows,
    import_meta,
    resolve_vocab,
    write_import,
)
from ckptkit_converters.megatron.legacy import import_legacy
from ckptkit_converters.common.renamed import divisible_by_renamed

__all__ = ["import_legacy", "import_torch_dist", "read_torch_dist", "resolve_vocab"]


class _Cut:
    """A piece source whose vocab pieces are row ranges of their chunk (``rows[ref] = (lo, hi)``): the
    true vocabulary's rows, or the padding rows kept beside it (``<key>.vocab_padding``)."""

    def __init__(self, inner: Any, rows: Mapping[int, tuple[int, int]]) -> None:
        self._inner = inner
        self._rows = rows

    @property
    def bytes_read(self) -> int:
        return self._inner.bytes_read

    def __len__(self) -> int:
        return len(self._inner)

    def __getitem__(self, ref: int) -> torch.Tensor:
        t = self._inner[ref]
        cut = self._rows.get(ref)
        return t if cut is None else t[cut[0]:cut[1]].contiguous()


def read_torch_dist(folder: str) -> tuple[DcpCheckpoint, dict[str, Any]]:
    """The validated DCP metadata and the decoded ``common.pt`` of a torch_dist directory."""
    fmt.read_config(folder)
    where = os.path.join(folder, METADATA_NAME)
    try:  # through the store: a regular file inside the folder, within the metadata size limit
        data = LocalStore(folder).read_bytes(METADATA_NAME, limit=MAX_METADATA_BYTES)
    except CheckpointNotFoundError:
        raise ManifestError(f"{where}: missing (the torch_dist save did not finish: DCP writes it last)") from None
    ckpt = parse_metadata(fmt.load_metadata_pickle(data, where), where)
    common_path = os.path.join(folder, fmt.COMMON_NAME)
    if not os.path.lexists(common_path):
        raise CheckpointNotFoundError(f"{common_path}: missing (every torch_dist save writes it)")
    common = fmt.load_pt(regular_file(folder, common_path))
    if not isinstance(common, dict):
        raise ManifestError(f"{folder}/{fmt.COMMON_NAME}: expected a dict, got {type(common).__name__}")
    return ckpt, common


@dataclass
class _PlacedChunks:
    """The DCP chunks as the import writes them: per writer rank, the chunks it reads (``reads``) and
    the pieces they become (``pieces``, in the same order), and which rows of its chunk a vocab piece
    holds where the chunk reaches into the padding (``rows[rank][ref] = (lo, hi)``)."""

    specs: dict[str, StoredTensor] = field(default_factory=dict)
    reads: dict[int, list[tuple[Any, Any]]] = field(default_factory=dict)
    pieces: RankPieces = field(default_factory=dict)
    rows: dict[int, dict[int, tuple[int, int]]] = field(default_factory=dict)

    def add(self, rank: int, read: tuple[Any, Any], key: str, box: Box, rows: tuple[int, int] | None) -> None:
        if not box.numel:
            return
        if rows is not None:
            self.rows.setdefault(rank, {})[len(self.reads.get(rank, []))] = rows
        self.reads.setdefault(rank, []).append(read)
        self.pieces.setdefault(rank, []).append((key, Region(box)))


def _place_chunks(stored: Mapping[str, tuple[str, Any]], ranks: Mapping[str, int], vocab_size: int) -> _PlacedChunks:
    """Every DCP chunk of the stored tensors becomes a piece of the rank whose file holds it: no gather.

    Vocab tensors are stored as the live adapter stores them: the true vocabulary as ``<key>``, the
    saving layout's padding rows as ``<key>.vocab_padding`` (Megatron trains those rows too: the padded
    logits enter its softmax, so a resume at the same padding is exact only with them). A chunk across
    the boundary becomes one piece of each."""
    placed = _PlacedChunks()
    for out_key, (key, t) in stored.items():
        if key not in names.VOCAB_TENSORS:
            placed.specs[out_key] = StoredTensor(t.dtype, tuple(t.shape))
            for c in t.chunks:
                placed.add(ranks[c.blob.file], (t, c), out_key, c.box, None)
            continue
        rest = tuple(t.shape[1:])
        pad_key = out_key + names.VOCAB_PADDING_SUFFIX
        placed.specs[out_key] = StoredTensor(t.dtype, (vocab_size, *rest))
        if t.shape[0] > vocab_size:
            placed.specs[pad_key] = StoredTensor(t.dtype, (t.shape[0] - vocab_size, *rest))
        for c in t.chunks:
            rank, (first, *others), (n, *sizes) = ranks[c.blob.file], c.box.offsets, c.box.sizes
            real = max(0, min(first + n, vocab_size) - first)
            whole = real == n
            placed.add(rank, (t, c), out_key, Box((first, *others), (real, *sizes)), None if whole else (0, real))
            if real < n:
                placed.add(rank, (t, c), pad_key, Box((first + real - vocab_size, *others), (n - real, *sizes)),
                           None if real == 0 else (real, n))
    return placed


def _skipped(ckpt: DcpCheckpoint, stored: Mapping[str, tuple[str, Any]]) -> tuple[str, ...]:
    """What the import leaves out, listed in its result: tensors not imported and non-tensor items."""
    taken = {t.fqn for _, t in stored.values()}
    return tuple(sorted({k for k in ckpt.tensors if k not in taken} | {k.split("/")[0] for k in ckpt.items}))


def _check_model(model: Mapping[str, Any], vocab_size: int, make_vocab_size_divisible_by: int, tp: int,
                 folder: str) -> None:
    """Vocab rows and tensor names checked before anything is written: a wrong vocabulary or an
    unknown name (no partition rule to guess) fails naming it, with no partial output."""
    for key in names.VOCAB_TENSORS:
        if key in model:
            check_vocab_rows(key, model[key].shape[0], vocab_size, make_vocab_size_divisible_by, tp,
                             f"{folder}/{METADATA_NAME}")
    for key in model:
        names.rule_for(key, divisible_by=make_vocab_size_divisible_by)


@divisible_by_renamed
def import_torch_dist(source: str | os.PathLike[str], dest: str | os.PathLike[str], *, vocab_size: int | None = None,
                      make_vocab_size_divisible_by: int | None = None, threads: int = 2,
                      weights_only: bool = False, progress: Progress | None = None,
                      storage_options: dict[str, Any] | None = None) -> MegatronConvertResult:
    """Write the Megatron torch_dist checkpoint ``source`` (a local directory) as a ckptkit checkpoint.

    What ``common.pt``'s Megatron-LM ``args`` record is read from there (``vocab_size`` when the
    run set ``--vocab-size``, ``make_vocab_size_divisible_by``, ``padded_vocab_size``,
    ``num_layers``, parallel sizes); ``vocab_size`` (the true vocabulary: Megatron stores only
    the padded one) and ``make_vocab_size_divisible_by`` are needed only where they do not
    (given and recorded must agree; missing ones raise
    :class:`~ckptkit.offline.formats.MissingImportOptions`). ``divisible_by=``: the old keyword,
    one more release, with a DeprecationWarning. Model tensors (vocab padding rows kept apart) and
    the optimizer state, in model space or in ``dp_reshardable`` buckets (see the module docstring);
    Transformer Engine FP8 ``_extra_state`` payloads (:mod:`.extra_states`); other non-tensor items
    (RNG, extra state in another form) are listed in ``skipped``. ``weights_only``: the optimizer's tensors
    are not read (listed in ``skipped``), and no optimizer record is written.
    """
    t0 = time.perf_counter()
    folder = os.fspath(source)
    ckpt, common = read_torch_dist(folder)
    args = fmt.SavedArgs.of(common.get("args"))
    src = open_store(folder)
    ranks, world = data_files(src, ckpt)
    model = {k: t for k, t in ckpt.tensors.items() if not _is_optimizer_key(k)}
    if names.EMBEDDING not in model:
        raise ManifestError(f"{folder}: no {names.EMBEDDING!r} tensor (not a Megatron GPT checkpoint?)")
    emb = model[names.EMBEDDING]
    tp = len({c.box.offsets[0] for c in emb.chunks})
    vocab_size, divisible = resolve_vocab(vocab_size, make_vocab_size_divisible_by, args, emb.shape[0], folder)
    _check_model(model, vocab_size, divisible, tp, folder)
    qkv = f"{names.LAYER_PREFIX}{names.LINEAR_QKV}.weight"
    num_layers = model[qkv].shape[0] if qkv in model else (args.num_layers or 0)
    where = f"{folder}/{fmt.COMMON_NAME}"
    check_layer_count(num_layers, args, where)
    pp = args.pp
    dp = args.world_size // (tp * pp) if args.world_size and pp else None
    with ThreadPoolExecutor(max_workers=threads * 3, thread_name_prefix="ckptkit-megatron-read") as pool:
        stored, optimizer, skipped = _stored(folder, ckpt, common, model, src, ranks, pool, weights_only)
        placed = _place_chunks(stored, ranks, vocab_size)
        payloads = extra_states.read_payloads(src, ckpt, ranks)
        placed.specs.update(payloads.specs())
        for rank in payloads.by_rank:
            placed.pieces.setdefault(rank, []).extend(payloads.pieces(rank))
        skipped = _unconsumed(skipped, ckpt, payloads.consumed)
        meta = import_meta("torch_dist", fmt.iteration_of(common), num_layers, vocab_size, divisible, tp, pp, dp,
                           args.vpp, names.OUTPUT not in model,
                           optimizer=optimizer_record.optimizer_record(stored, optimizer, where),
                           scheduler=optimizer_record.scheduler_record(common, where))
        run = ImportRun(os.fspath(dest), src.url, threads, progress, storage_options, t0)
        return write_import(run, world, placed.specs, placed.pieces,
                            lambda rank, _: extra_states.WithPayloads(
                                _Cut(BucketPieces(src, placed.reads.get(rank, []), pool, 2), placed.rows.get(rank, {})),
                                payloads.by_rank.get(rank, [])),
                            meta, skipped)


def _unconsumed(skipped: tuple[str, ...], ckpt: DcpCheckpoint, consumed: set[str]) -> tuple[str, ...]:
    """``skipped`` less the item keys every item of which the import carried (extra-state payloads)."""
    left = {fqn.split("/")[0] for fqn in ckpt.items if fqn not in consumed}
    carried = {fqn.split("/")[0] for fqn in consumed} - left
    return tuple(k for k in skipped if k not in carried)


_CHAINED = re.compile(r"^chained_[0-9]+\.")


def _is_optimizer_key(key: str) -> bool:
    """Megatron's optimizer tensors (a chained optimizer's parts may carry a ``chained_<i>.`` prefix)."""
    return _CHAINED.sub("", key).startswith("optimizer.")


def _stored(folder: str, ckpt: DcpCheckpoint, common: Mapping[str, Any], model: Mapping[str, Any], src: Any,
            ranks: Mapping[str, int], pool: ThreadPoolExecutor,
            weights_only: bool) -> tuple[dict[str, tuple[str, Any]], Any, tuple[str, ...]]:
    """What the import stores (ckptkit key -> (Megatron model key, tensor)): the model, and (unless
    ``weights_only``) the optimizer state from model space or from the distributed optimizer's
    ``dp_reshardable`` buckets (:mod:`.optimizer_buckets`); the saved optimizer's non-tensor state the record
    is read from; and what is left out."""
    stored: dict[str, tuple[str, Any]] = {MODEL + k: (k, t) for k, t in model.items()}
    if weights_only:
        return stored, None, _skipped(ckpt, stored)
    stored.update(_optimizer_tensors(ckpt, model))
    buckets = optimizer_buckets.read_buckets(ckpt, model, src, ranks, pool, f"{folder}/{METADATA_NAME}")
    optimizer = common.get("optimizer")
    if buckets is None:
        return stored, optimizer, _skipped(ckpt, stored)
    if any(k.startswith("optimizer/") for k in stored):
        raise ManifestError(f"{folder}: the optimizer state is saved twice, in model space (optimizer.state.*) "
                            "and in the distributed optimizer's buckets (optimizer.distributed.*)")
    stored.update(buckets.tensors)
    optimizer = {0: optimizer, **{i + 1: record for i, record in buckets.optimizer.items()}}
    return stored, optimizer, tuple(k for k in _skipped(ckpt, stored) if k not in buckets.consumed)


def _optimizer_tensors(ckpt: DcpCheckpoint, model: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    """``optimizer/<state>/<model key>`` -> (model key, DCP tensor) for the optimizer state Megatron saves
    in model space, ``optimizer.state.<state>.<model key>`` (megatron/core/dist_checkpointing/optimizer.py,
    and DistributedOptimizer.sharded_param_state_fully_reshardable): the plain optimizers' state and the
    distributed optimizer's ``fully_reshardable`` form (names: :data:`optimizer_record.STATE_NAMES`). Its
    ``dp_reshardable`` buckets (``optimizer.distributed.*``): :mod:`.optimizer_buckets`."""
    out: dict[str, tuple[str, Any]] = {}
    for fqn, t in ckpt.tensors.items():
        unchained = _CHAINED.sub("", fqn)  # a ChainedOptimizer's part saved with chained_optim_avoid_prefix off
        for state, name in optimizer_record.STATE_NAMES.items():
            prefix = f"optimizer.state.{state}."
            if unchained.startswith(prefix) and unchained[len(prefix):] in model:
                key = unchained[len(prefix):]
                if tuple(t.shape) != tuple(model[key].shape):
                    raise ManifestError(f"{fqn!r} has shape {list(t.shape)}, its parameter {list(model[key].shape)}")
                if f"optimizer/{name}/{key}" in out:
                    raise ManifestError(f"{fqn!r}: {key!r} has two saved {name} copies "
                                        f"({out[f'optimizer/{name}/{key}'][1].fqn!r} too)")
                out[f"optimizer/{name}/{key}"] = (key, t)
    return out
