"""Megatron-core checkpoints into and out of ckptkit (model weights).

* :func:`import_torch_dist`: a ``torch_dist`` directory (DCP + ``metadata.json``
  + ``common.pt``) -> a committed ckptkit checkpoint in model space: every
  DCP chunk becomes a piece written by the virtual rank whose ``.distcp`` file
  held it (no gather), vocab padding rows dropped, a :class:`PartitionRule`
  per tensor (:mod:`converters.megatron_names`), and ``megatron/meta``.
* :func:`import_legacy`: a legacy ``iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt``
  checkpoint -> the same. Each rank file becomes one virtual writer rank whose
  pieces are its TP-local tensors placed in model space (local layer numbers
  made global, SwiGLU ``[gate_r; up_r]`` split into its two fused parts), so
  nothing is stitched in memory: a few files are open at a time.
* :func:`converters.megatron_export.export_torch_dist`: a ckptkit Megatron checkpoint -> a ``torch_dist``
  directory for a chosen ``tp``/``pp`` that ``megatron.core.dist_checkpointing.load``
  accepts for a model built at that layout (vocab re-padded for the target tp).
  The DCP part is written by DCP's own ``FileSystemWriter`` and planner
  functions, one virtual rank at a time.

Facts the checkpoint records about itself are read from its Megatron-LM ``args``
(:class:`converters.megatron_format.SavedArgs`: ``vocab_size`` when the run was given
``--vocab-size``, ``make_vocab_size_divisible_by``, ``padded_vocab_size``, ``num_layers``,
parallel sizes, tied embeddings); only what they do not say is asked for
(:func:`resolve_vocab`, naming it).

Optimizer state: the non-distributed optimizer's model-space state
(``optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<key>``) is imported from
torch_dist as ``optimizer/{exp_avg,exp_avg_sq,main}/<key>``; the distributed
optimizer's flat buckets, legacy ``optimizer`` dicts and exports are not yet
(skipped tensors are listed). Every pickle is opened as :mod:`converters.megatron_format` says.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ckptkit.engine.offline_writer import (
    OfflineWriteOptions,
    write_offline,
)
from ckptkit.errors import CheckpointNotFoundError, LayoutError, ManifestError
from ckptkit.layout.box import Box, Region
from ckptkit.layout.manifest import ExplicitLayout, TensorMeta
from ckptkit.layout.strict_json import MAX_METADATA_BYTES
from ckptkit.layout.values import encode_value
from ckptkit.options import Progress
from ckptkit.storage.local import LocalStore
from ckptkit.storage.url import open_store
from ckptkit_converters.megatron import files as fmt
from ckptkit_converters.megatron.files import META_KEY, MODEL, MegatronConvertResult
from ckptkit_converters.megatron import names as names
from ckptkit_converters.dcp.convert import _check_files, _DcpPieces
from ckptkit_converters.dcp.files import (
    METADATA_NAME,
    DcpCheckpoint,
    parse_metadata,
    writer_ranks,
)
from ckptkit_converters.common.source_paths import regular_file

@dataclass(frozen=True)
class _Spec:
    dtype: str
    shape: tuple[int, ...]


# ---------------------------------------------------------------- shared import helpers


def _agree(given: int | None, saved: int | None, name: str, flag: str, where: str) -> int | None:
    if given is not None and saved is not None and given != saved:
        raise LayoutError(f"{where}: {flag} {given} disagrees with the checkpoint's {name} {saved} (its args)")
    return given if given is not None else saved


def resolve_vocab(vocab_size: int | None, divisible_by: int | None, args: fmt.SavedArgs, padded_rows: int,
                  where: str) -> tuple[int, int]:
    """The true vocabulary size and ``make_vocab_size_divisible_by``: what the checkpoint's ``args``
    record, else what is given (both: they must agree). Whatever neither says is asked for, by
    name, in one :class:`~ckptkit.offline.formats.MissingImportOptions`."""
    from ckptkit.offline.formats import MissingImportOptions

    if args.padded_vocab_size is not None and args.padded_vocab_size != padded_rows:
        raise ManifestError(f"{where}: its args record padded_vocab_size {args.padded_vocab_size}, but "
                            f"{names.EMBEDDING!r} has {padded_rows} rows")
    vocab = _agree(vocab_size, args.vocab_size, "vocab_size", "--vocab-size", where)
    d = _agree(divisible_by, args.divisible_by, "make_vocab_size_divisible_by", "--divisible-by", where)
    missing = {name: flag for name, flag, value in (("vocab_size", "--vocab-size N", vocab),
                                                     ("make_vocab_size_divisible_by", "--divisible-by N", d))
               if value is None}
    if missing:
        recorded = ("its args do not record " if args.recorded else "it has no Megatron-LM args recording ")
        why = (f" (Megatron-LM keeps the padded vocabulary, {padded_rows} rows here, and the tokenizer's true "
               "size only when --vocab-size was given)" if "vocab_size" in missing else "")
        raise MissingImportOptions(
            f"{where}: {recorded}{' or '.join(missing)}{why}; pass "
            + " and ".join(f"{n} (CLI: {flag})" for n, flag in missing.items()), tuple(missing))
    assert vocab is not None and d is not None
    return vocab, d


def _check_layers(counted: int, args: fmt.SavedArgs, where: str) -> None:
    if args.num_layers is not None and counted and args.num_layers != counted:
        raise ManifestError(f"{where}: its args record num_layers {args.num_layers}, the tensors hold {counted} layers")


def _check_vocab(key: str, padded: int, vocab: int, d: int, tp: int, where: str) -> None:
    want = names.padded_vocab(vocab, d, tp)
    if padded != want:
        raise LayoutError(f"{where}: {key!r} has {padded} rows, but vocab_size {vocab} padded to a multiple of "
                          f"divisible_by {d} x tp {tp} is {want}: check --vocab-size / --divisible-by")


def _layouts(specs: Mapping[str, _Spec], pieces: Mapping[int, Sequence[tuple[str, Region]]],
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


def _write(dest: str, world: int, specs: dict[str, _Spec], pieces: dict[int, list[tuple[str, Region]]],
           source: Callable[[int, Any], Any], meta: dict[str, Any], source_url: str, threads: int,
           progress: Progress | None, t0: float, skipped: tuple[str, ...],
           storage_options: dict[str, Any] | None = None) -> MegatronConvertResult:
    shapes = {k[len(MODEL):]: s.shape for k, s in specs.items() if k.startswith(MODEL)}
    d = meta["make_vocab_size_divisible_by"]
    rules = {k: names.rule_for(_megatron_key(k), divisible_by=d, ffn=names.gated_ffn(_megatron_key(k), shapes))
             for k in specs}
    out = open_store(dest, storage_options)
    result = write_offline(
        out, world_size=world, tensors=specs, pieces=pieces, source=source,
        values={META_KEY: encode_value(json.dumps(meta, sort_keys=True), META_KEY)},
        meta={"user": {}, "converted_from": {"url": source_url, "format": f"megatron-{meta['source']}",
                                            "skipped": list(skipped)}},
        layouts=_layouts(specs, pieces, rules), options=OfflineWriteOptions(threads=threads), progress=progress,
        what=f"importing {source_url} into {out.url}")
    return MegatronConvertResult(source_url, out.url, "ckptkit", len(specs), result.nbytes, result.bytes_read,
                                 time.perf_counter() - t0, meta, skipped)


def _meta(source: str, iteration: int, num_layers: int, vocab: int, d: int, tp: int, pp: int | None,
          dp: int | None, vpp: int | None, tied: bool) -> dict[str, Any]:
    return {"format": 1, "iteration": iteration, "num_layers": num_layers, "vocab_size": vocab,
            "make_vocab_size_divisible_by": d, "tied": tied,
            "layout": {"tp": tp, "pp": pp, "dp": dp, "vpp": vpp}, "source": source}


class _Clipped:
    """A piece source whose vocab pieces drop padding rows (``keep[ref]`` rows kept, or all)."""

    def __init__(self, inner: Any, keep: Mapping[int, int]) -> None:
        self._inner = inner
        self._keep = keep

    @property
    def bytes_read(self) -> int:
        return self._inner.bytes_read

    def __len__(self) -> int:
        return len(self._inner)

    def __getitem__(self, ref: int) -> torch.Tensor:
        t = self._inner[ref]
        n = self._keep.get(ref)
        return t if n is None else t[:n].contiguous()


# ---------------------------------------------------------------- torch_dist import


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


def import_torch_dist(source: str | os.PathLike[str], dest: str | os.PathLike[str], *, vocab_size: int | None = None,
                      divisible_by: int | None = None, threads: int = 2, progress: Progress | None = None,
                      storage_options: dict[str, Any] | None = None) -> MegatronConvertResult:
    """Write the Megatron torch_dist checkpoint ``source`` (a local directory) as a ckptkit checkpoint.

    What ``common.pt``'s Megatron-LM ``args`` record is read from there (``vocab_size`` when the
    run set ``--vocab-size``, ``make_vocab_size_divisible_by``, ``padded_vocab_size``,
    ``num_layers``, parallel sizes); ``vocab_size`` (the true vocabulary: Megatron stores only
    the padded one) and ``divisible_by`` are needed only where they do not (given and recorded
    must agree; missing ones raise :class:`~ckptkit.offline.formats.MissingImportOptions`).
    Model tensors and the non-distributed optimizer's model-space state; the distributed
    optimizer's flat buckets and non-tensor items (``_extra_state``, RNG, param groups) are
    listed in ``skipped``.
    """
    t0 = time.perf_counter()
    folder = os.fspath(source)
    ckpt, common = read_torch_dist(folder)
    args = fmt.SavedArgs.of(common.get("args"))
    src = open_store(folder)
    files = ckpt.files()
    _check_files(src, files)
    ranks = writer_ranks(list(files))
    listed = [r for r in map(_file_rank, src.list_children()) if r is not None]
    world = max([*ranks.values(), *listed], default=0) + 1
    model = {k: t for k, t in ckpt.tensors.items() if not k.startswith("optimizer.")}
    stored = {MODEL + k: (k, t) for k, t in model.items()}
    stored.update(_optimizer_tensors(ckpt, model))
    taken = {t.fqn for _, t in stored.values()}
    skipped = tuple(sorted({k for k in ckpt.tensors if k not in taken} | {k.split("/")[0] for k in ckpt.items}))
    if names.EMBEDDING not in model:
        raise ManifestError(f"{folder}: no {names.EMBEDDING!r} tensor (not a Megatron GPT checkpoint?)")
    emb = model[names.EMBEDDING]
    tp = len({c.box.offsets[0] for c in emb.chunks})
    vocab_size, d = resolve_vocab(vocab_size, divisible_by, args, emb.shape[0], folder)
    for key in names.VOCAB_TENSORS:
        if key in model:
            _check_vocab(key, model[key].shape[0], vocab_size, d, tp, f"{folder}/{METADATA_NAME}")
    for key in model:
        names.rule_for(key, divisible_by=d)  # unknown names fail here, before anything is written
    specs: dict[str, _Spec] = {}
    by_rank: dict[int, list[tuple[Any, Any]]] = {}
    pieces: dict[int, list[tuple[str, Region]]] = {}
    keep: dict[int, dict[int, int]] = {}
    for out_key, (key, t) in stored.items():
        shape = (vocab_size, *t.shape[1:]) if key in names.VOCAB_TENSORS else t.shape
        specs[out_key] = _Spec(t.dtype, tuple(shape))
        for c in t.chunks:
            box = c.box
            if key in names.VOCAB_TENSORS:
                rows = min(box.offsets[0] + box.sizes[0], vocab_size) - box.offsets[0]
                if rows <= 0:
                    continue  # a chunk of padding only
                if rows < box.sizes[0]:
                    keep.setdefault(ranks[c.blob.file], {})[len(by_rank.get(ranks[c.blob.file], []))] = rows
                box = Box(box.offsets, (rows, *box.sizes[1:]))
            if box.numel:
                r = ranks[c.blob.file]
                by_rank.setdefault(r, []).append((t, c))
                pieces.setdefault(r, []).append((out_key, Region(box)))
    num_layers = model["decoder.layers.self_attention.linear_qkv.weight"].shape[0] \
        if "decoder.layers.self_attention.linear_qkv.weight" in model else (args.num_layers or 0)
    _check_layers(num_layers, args, f"{folder}/{fmt.COMMON_NAME}")
    tied = names.OUTPUT not in model
    pp = args.pp
    dp = args.world_size // (tp * pp) if args.world_size and pp else None
    meta = _meta("torch_dist", fmt.iteration_of(common), num_layers, vocab_size, d, tp, pp, dp, args.vpp, tied)
    with ThreadPoolExecutor(max_workers=threads * 3, thread_name_prefix="ckptkit-megatron-read") as pool:
        return _write(os.fspath(dest), world, specs, pieces,
                      lambda rank, _: _Clipped(_DcpPieces(src, by_rank.get(rank, []), pool, 2), keep.get(rank, {})),
                      meta, src.url, threads, progress, t0, skipped, storage_options)


# Megatron's non-distributed optimizer saves its state in model space as
# ``optimizer.state.<state>.<model key>`` (megatron/core/dist_checkpointing/optimizer.py);
# ``fp32_param`` are the fp32 master weights of bf16/fp16 training (ckptkit's ``main``).
_OPTIMIZER_STATES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "fp32_param": "main"}


def _optimizer_tensors(ckpt: DcpCheckpoint, model: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    """``optimizer/<state>/<model key>`` -> (model key, DCP tensor) for the model-space optimizer
    state; the distributed optimizer's flat bucket buffers (``optimizer.distributed.*``) are not."""
    out = {}
    for fqn, t in ckpt.tensors.items():
        for state, name in _OPTIMIZER_STATES.items():
            prefix = f"optimizer.state.{state}."
            if fqn.startswith(prefix) and fqn[len(prefix):] in model:
                key = fqn[len(prefix):]
                if tuple(t.shape) != tuple(model[key].shape):
                    raise ManifestError(f"{fqn!r} has shape {list(t.shape)}, its parameter {list(model[key].shape)}")
                out[f"optimizer/{name}/{key}"] = (key, t)
    return out


def _megatron_key(key: str) -> str:
    """The Megatron model key a ckptkit key stores (``model/<k>`` or ``optimizer/<state>/<k>``)."""
    return key[len(MODEL):] if key.startswith(MODEL) else key.split("/", 2)[2]


def _file_rank(name: str) -> int | None:
    from ckptkit_converters.dcp.files import file_rank

    return file_rank(name)


# ---------------------------------------------------------------- legacy import


@dataclass(frozen=True)
class _LegacyPiece:
    name: str  # module state-dict name in the file's chunk
    chunk: str  # "model" or "model<v>"
    rows: tuple[int, int] | None  # slice of axis 0 of the local tensor (fused part / vocab clip), or all
    layered: bool  # prepend the layer axis


class _LegacySource:
    """One legacy rank file's pieces, read from the file (memory-mapped) when first asked for."""

    def __init__(self, path: str, refs: Sequence[_LegacyPiece]) -> None:
        self._path = path
        self._refs = refs
        self._state: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self.bytes_read = 0

    def __len__(self) -> int:
        return len(self._refs)

    def __getitem__(self, ref: int) -> torch.Tensor:
        with self._lock:
            if self._state is None:
                self._state = fmt.load_pt(self._path, mmap=True)
        p = self._refs[ref]
        t = self._state[p.chunk][p.name]
        if p.rows is not None:
            t = t[p.rows[0]:p.rows[1]]
        if p.layered:
            t = t.unsqueeze(0)
        self.bytes_read += t.numel() * t.element_size()
        return t.contiguous()


def _model_chunks(state: Mapping[str, Any], where: str) -> dict[int, dict[str, torch.Tensor]]:
    if "model" in state:
        chunks = {0: state["model"]}
    else:
        chunks = {int(k[5:]): v for k, v in state.items() if k.startswith("model") and k[5:].isdigit()}
    if not chunks:
        raise ManifestError(f"{where}: no 'model' (or 'model0', 'model1' ...) state dict")
    for v, sd in chunks.items():
        if not isinstance(sd, Mapping):
            raise ManifestError(f"{where}: 'model{v if len(chunks) > 1 else ''}' is not a state dict")
    return chunks


def import_legacy(source: str | os.PathLike[str], dest: str | os.PathLike[str], *, vocab_size: int | None = None,
                  divisible_by: int | None = None, tied: bool | None = None, threads: int = 2,
                  progress: Progress | None = None,
                  storage_options: dict[str, Any] | None = None) -> MegatronConvertResult:
    """Write a legacy Megatron checkpoint as a ckptkit checkpoint (model weights).

    ``source``: an ``iter_XXXXXXX`` (or ``release``) directory, or the save root
    (its ``latest_checkpointed_iteration.txt`` picks the iteration). The rank files'
    Megatron-LM ``args`` are read as for :func:`import_torch_dist`; ``vocab_size`` and
    ``divisible_by`` are needed only where they do not record them. ``tied``:
    whether the output layer is tied to the embedding, when ``args`` does not say
    (a tied model's last stage holds a copy of the embedding, dropped here).
    """
    t0 = time.perf_counter()
    folder = fmt.resolve_legacy_dir(os.fspath(source))  # the tracker's iteration: one plain name, inside source
    files = fmt.legacy_files(folder, os.fspath(source))
    tp = max(f.tp for f in files) + 1
    pp = max(f.pp for f in files) + 1
    # pass 1 (memory-mapped): names, shapes and layer counts of every rank's chunks
    inventory: dict[tuple[int, int], dict[int, dict[str, tuple[tuple[int, ...], str]]]] = {}
    first: dict[str, Any] = {}
    for f in files:
        state = fmt.load_pt(f.path, mmap=True)
        if not isinstance(state, dict):
            raise ManifestError(f"{f.path}: expected a dict, got {type(state).__name__}")
        if not first:
            first = state
        inventory[(f.tp, f.pp)] = {
            v: {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in sd.items()
                if isinstance(t, torch.Tensor)}
            for v, sd in _model_chunks(state, f.path).items()}
        del state
    args = fmt.SavedArgs.of(first.get("args"))
    emb = inventory[(0, 0)].get(0, {}).get(names.EMBEDDING)  # stage 0, first chunk: TP-split rows
    if emb is None:
        raise ManifestError(f"{files[0].path}: no {names.EMBEDDING!r} tensor (not a Megatron GPT checkpoint?)")
    vocab_size, d = resolve_vocab(vocab_size, divisible_by, args, emb[0][0] * tp, folder)
    is_tied = tied if tied is not None else (not args.untied if args.untied is not None else False)
    vpp = len(inventory[(0, 0)])
    # global layer offset of each (virtual chunk, stage), in Megatron's order: chunk-major
    counts: dict[tuple[int, int], int] = {}
    for (t, p), chunks in inventory.items():
        if len(chunks) != vpp:
            raise ManifestError(f"{folder}: mp_rank_{t:02d}_{p:03d} holds {len(chunks)} model chunks, rank 0 {vpp}")
        for v, tensors in chunks.items():
            layers = {lk[1] for n in tensors if (lk := names.legacy_key(n)) is not None and lk[1] is not None}
            n = max(layers) + 1 if layers else 0
            if counts.setdefault((v, p), n) != n:
                raise ManifestError(f"{folder}: TP ranks of stage {p} (chunk {v}) hold different layer counts")
    offset: dict[tuple[int, int], int] = {}
    total = 0
    for v in range(vpp):
        for p in range(pp):
            offset[(v, p)] = total
            total += counts[(v, p)]
    # model-space shapes and every rank's pieces
    specs: dict[str, _Spec] = {}
    pieces: dict[int, list[tuple[str, Region]]] = {}
    refs: dict[int, list[_LegacyPiece]] = {}
    fc2 = next((s for c in inventory[(0, 0)].values() for n, (s, _) in c.items()
                if n.endswith("mlp.linear_fc2.weight")), None)
    ffn_local = fc2[-1] if fc2 is not None else None
    for f in files:
        rank = f.pp * tp + f.tp
        where = f"{f.path}"
        for v, tensors in inventory[(f.tp, f.pp)].items():
            chunk = "model" if vpp == 1 and "model" in first else f"model{v}"
            for name, (shape, dtype) in sorted(tensors.items()):
                mapped = names.legacy_key(name)
                if mapped is None:
                    continue
                key, layer = mapped
                if key == names.OUTPUT and is_tied:
                    continue
                try:
                    rule = names.rule_for(key, divisible_by=d)
                except LayoutError as exc:
                    raise LayoutError(f"{where}: tensor {name!r}: {exc}") from None
                layered = layer is not None
                axis = None if rule.tp_axis is None else rule.tp_axis - (1 if layered else 0)
                if axis is None and f.tp != 0:
                    continue  # replicated over TP: TP rank 0's copy is the one stored
                gshape = list(shape)
                if axis is not None:
                    gshape[axis] *= tp
                if key in names.VOCAB_TENSORS:
                    _check_vocab(key, gshape[0], vocab_size, d, tp, where)
                    gshape[0] = vocab_size
                full = tuple([total, *gshape] if layered else gshape)
                old = specs.setdefault(MODEL + key, _Spec(dtype, full))
                if old != _Spec(dtype, full):
                    raise ManifestError(f"{where}: tensor {name!r} ({dtype}, {list(full)} in model space) disagrees "
                                        f"with other ranks ({old.dtype}, {list(old.shape)})")
                glayer = offset[(v, f.pp)] + layer if layered else None
                parts: list[tuple[int, int, int]] = []  # (local row start, rows, global start along axis)
                if axis is None:
                    parts.append((0, shape[0] if shape else 0, 0))
                elif names.is_fused_glu(key) and ffn_local is not None and axis == 0 and shape[0] == 2 * ffn_local:
                    parts += [(0, ffn_local, f.tp * ffn_local), (ffn_local, ffn_local, (tp + f.tp) * ffn_local)]
                else:
                    parts.append((0, shape[axis], f.tp * shape[axis]))
                for start, rows, goff in parts:
                    offs, sizes = [0] * len(shape), list(shape)
                    clip = None
                    if axis is not None:
                        offs[axis] = goff
                        if axis == 0:
                            sizes[0] = rows
                            clip = (start, start + rows) if len(parts) > 1 else None
                        if key in names.VOCAB_TENSORS:
                            keep_rows = min(goff + shape[0], vocab_size) - goff
                            if keep_rows <= 0:
                                continue
                            sizes[0] = keep_rows
                            clip = (0, keep_rows) if keep_rows < shape[0] else None
                    if layered:
                        offs, sizes = [glayer, *offs], [1, *sizes]
                    if 0 in sizes:
                        continue
                    pieces.setdefault(rank, []).append((MODEL + key, Region(Box(tuple(offs), tuple(sizes)))))
                    refs.setdefault(rank, []).append(_LegacyPiece(name, chunk, clip, layered))
    _check_layers(total, args, folder)
    iteration = fmt.iteration_of(first)
    dp = args.world_size // (tp * pp) if args.world_size else None
    meta = _meta("legacy", iteration, total, vocab_size, d, tp, pp, dp, vpp if vpp > 1 else None, is_tied)
    paths = {f.pp * tp + f.tp: f.path for f in files}
    return _write(os.fspath(dest), tp * pp, specs, pieces, lambda r, _: _LegacySource(paths[r], refs.get(r, [])),
                  meta, folder, threads, progress, t0, (), storage_options)



