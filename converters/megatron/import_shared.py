"""The steps both Megatron imports share (torch_dist: :mod:`.importer`, legacy: :mod:`.legacy`).

Either import reads its source into the same three things (a model-space spec per tensor, the
pieces each virtual writer rank stores, a source of their bytes) and then: checks the vocabulary
and layer count against what the checkpoint's ``args`` record, writes ``megatron/meta``, and
commits through :func:`ckptkit.engine.offline_writer.write_offline` with a partition rule per
tensor. Kept here once so the two formats cannot drift in what they check or record.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptkit.engine.offline_writer import OfflineWriteOptions, StoredTensor, write_offline
from ckptkit.errors import LayoutError, ManifestError
from ckptkit.layout.box import Region
from ckptkit.layout.manifest import ExplicitLayout, TensorMeta
from ckptkit.layout.rules import PartitionRule
from ckptkit.layout.values import encode_value
from ckptkit.options import Progress
from ckptkit.storage.url import open_store
from ckptkit_converters.megatron import files as fmt
from ckptkit.adapters.megatron import extra_state
from ckptkit_converters.megatron import names
from ckptkit_converters.megatron.files import META_KEY, MODEL, MegatronConvertResult
from ckptkit_converters.common.renamed import divisible_by_renamed

RankPieces = dict[int, list[tuple[str, Region]]]
"""Virtual writer rank -> the (ckptkit key, model-space region) pieces it stores, in write order."""


@dataclass(frozen=True)
class ImportRun:
    """Where an import writes and how, as the caller gave it: passed whole to :func:`write_import`."""

    dest: str
    source_url: str
    threads: int
    progress: Progress | None
    storage_options: dict[str, Any] | None
    started: float
    """``time.perf_counter()`` when the import began: the result's duration."""


# ---------------------------------------------------------------- what the checkpoint records


def _agree(given: int | None, saved: int | None, name: str, flag: str, where: str) -> int | None:
    """The given value, else the recorded one; both must agree, since either may be what the run used."""
    if given is not None and saved is not None and given != saved:
        raise LayoutError(f"{where}: {flag} {given} disagrees with the checkpoint's {name} {saved} (its args)")
    return given if given is not None else saved


@divisible_by_renamed
def resolve_vocab(vocab_size: int | None, make_vocab_size_divisible_by: int | None, args: fmt.SavedArgs,
                  padded_rows: int, where: str) -> tuple[int, int]:
    """The true vocabulary size and ``make_vocab_size_divisible_by``: what the checkpoint's ``args``
    record, else what is given (both: they must agree). Whatever neither says is asked for, by
    name, in one :class:`~ckptkit.offline.formats.MissingImportOptions`. (``divisible_by=``: the
    old keyword, one more release, with a DeprecationWarning.)"""
    from ckptkit.offline.formats import MissingImportOptions

    if args.padded_vocab_size is not None and args.padded_vocab_size != padded_rows:
        raise ManifestError(f"{where}: its args record padded_vocab_size {args.padded_vocab_size}, but "
                            f"{names.EMBEDDING!r} has {padded_rows} rows")
    vocab = _agree(vocab_size, args.vocab_size, "vocab_size", "--vocab-size", where)
    divisible = _agree(make_vocab_size_divisible_by, args.divisible_by, "make_vocab_size_divisible_by",
                       "--divisible-by", where)
    missing = {name: flag for name, flag, value in (("vocab_size", "--vocab-size N", vocab),
                                                     ("make_vocab_size_divisible_by", "--divisible-by N", divisible))
               if value is None}
    if missing:
        recorded = ("its args do not record " if args.recorded else "it has no Megatron-LM args recording ")
        why = (f" (Megatron-LM keeps the padded vocabulary, {padded_rows} rows here, and the tokenizer's true "
               "size only when --vocab-size was given)" if "vocab_size" in missing else "")
        raise MissingImportOptions(
            f"{where}: {recorded}{' or '.join(missing)}{why}; pass "
            + " and ".join(f"{n} (CLI: {flag})" for n, flag in missing.items()), tuple(missing))
    assert vocab is not None and divisible is not None
    return vocab, divisible


def check_layer_count(counted: int, args: fmt.SavedArgs, where: str) -> None:
    """The layers the tensors hold must be the ``num_layers`` the args record: a mismatch means files
    of another run (or a missing stage) were mixed in."""
    if args.num_layers is not None and counted and args.num_layers != counted:
        raise ManifestError(f"{where}: its args record num_layers {args.num_layers}, the tensors hold {counted} layers")


def check_vocab_rows(key: str, padded: int, vocab: int, make_vocab_size_divisible_by: int, tp: int,
                     where: str) -> None:
    """A vocab tensor's rows must be Megatron's padding of ``vocab`` at ``tp``: otherwise the vocabulary
    or the multiple is wrong, and dropping "padding" rows would drop real ones."""
    want = names.padded_vocab(vocab, make_vocab_size_divisible_by, tp)
    if padded != want:
        raise LayoutError(f"{where}: {key!r} has {padded} rows, but vocab_size {vocab} padded to a multiple of "
                          f"divisible_by {make_vocab_size_divisible_by} x tp {tp} is {want}: "
                          "check --vocab-size / --divisible-by")


# ---------------------------------------------------------------- writing the ckptkit checkpoint


def import_meta(source: str, iteration: int, num_layers: int, vocab: int, make_vocab_size_divisible_by: int,
                tp: int, pp: int | None, dp: int | None, vpp: int | None, tied: bool, *,
                optimizer: dict[str, Any] | None = None, scheduler: dict[str, Any] | None = None) -> dict[str, Any]:
    """``megatron/meta``: what the live adapter and the export need to lay the model out again, and, when
    the import holds a whole optimizer (:mod:`.optimizer_record`), what the adapter resumes it from."""
    return {"format": 1, "iteration": iteration, "num_layers": num_layers, "vocab_size": vocab,
            "make_vocab_size_divisible_by": make_vocab_size_divisible_by, "tied": tied,
            "layout": {"tp": tp, "pp": pp, "dp": dp, "vpp": vpp}, "source": source,
            "optimizer": optimizer, "scheduler": scheduler}


def megatron_key(key: str) -> str:
    """The Megatron model key a ckptkit key stores (``model/<k>`` or ``optimizer/<state>/<k>``)."""
    return key[len(MODEL):] if key.startswith(MODEL) else key.split("/", 2)[2]


def _layouts(specs: Mapping[str, StoredTensor], pieces: Mapping[int, Sequence[tuple[str, Region]]],
             rules: Mapping[str, Any]) -> dict[str, TensorMeta]:
    """Manifest entries carrying the rules: the pieces sorted exactly as the merge sorts them."""
    by_key: dict[str, list[tuple[Region, int]]] = {k: [] for k in specs}
    for rank, items in pieces.items():
        for key, region in items:
            by_key[key].append((region, rank))
    return {k: TensorMeta(k, s.dtype, s.shape,
                          ExplicitLayout(tuple(sorted(by_key[k], key=lambda p: (p[0].key(), p[1])))),
                          rule=rules[k])
            for k, s in sorted(specs.items())}


def _partition_rules(specs: Mapping[str, StoredTensor],
                     make_vocab_size_divisible_by: int) -> dict[str, PartitionRule | None]:
    """Each stored tensor's rule (optimizer state shares its parameter's), gated FFN sizes read off the
    stored shapes: what lets ``ckptkit reshard`` lay the model out at another tp/pp offline."""
    shapes = {k[len(MODEL):]: s.shape for k, s in specs.items() if k.startswith(MODEL)}
    return {k: None if k.endswith(names.VOCAB_PADDING_SUFFIX)  # the saving layout's padding rows: no rule
            else extra_state.rule_of(*extra_state.parse_name(k)) if k.startswith(extra_state.PREFIX)
            else names.rule_for(megatron_key(k), divisible_by=make_vocab_size_divisible_by,
                                ffn=names.gated_ffn(megatron_key(k), shapes))
            for k in specs}


def write_import(run: ImportRun, world: int, specs: dict[str, StoredTensor], pieces: RankPieces,
                 source: Callable[[int, Any], Any], meta: dict[str, Any],
                 skipped: tuple[str, ...]) -> MegatronConvertResult:
    """Commit the pieces as ``world`` virtual writer ranks, with ``megatron/meta`` and the rules."""
    rules = _partition_rules(specs, meta["make_vocab_size_divisible_by"])
    out = open_store(run.dest, run.storage_options)
    result = write_offline(
        out, world_size=world, tensors=specs, pieces=pieces, source=source,
        values={META_KEY: encode_value(json.dumps(meta, sort_keys=True), META_KEY)},
        meta={"user": {}, "converted_from": {"url": run.source_url, "format": f"megatron-{meta['source']}",
                                            "skipped": list(skipped)}},
        layouts=_layouts(specs, pieces, rules), options=OfflineWriteOptions(threads=run.threads),
        progress=run.progress, what=f"importing {run.source_url} into {out.url}")
    return MegatronConvertResult(run.source_url, out.url, "ckptkit", len(specs), result.nbytes, result.bytes_read,
                                 time.perf_counter() - run.started, meta, skipped)
