"""A legacy Megatron checkpoint (``iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt``) into ckptkit.

Each rank file becomes one virtual writer rank whose pieces are its TP-local tensors placed in
model space: local layer numbers made global, SwiGLU ``[gate_r; up_r]`` split into its two fused
parts, vocab padding rows kept apart (``<key>.vocab_padding``). Nothing is stitched in memory: a
few files are open at a time, memory-mapped. The algorithm:

1. read every rank file's inventory (names, shapes, dtypes), and place its optimizer's state by parameter
   (:mod:`.legacy_optimizer`, :mod:`.legacy_distrib`: the weights and main copies are read to check it);
2. resolve the vocabulary and tying from the ``args`` and the embedding;
3. number the layers globally: each (virtual chunk, stage) holds a run of layers, chunk-major;
4. place every tensor of every rank, and every optimizer state as its weight, as pieces of its
   model-space tensor;
5. write them, each rank's pieces read from its own files.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptkit.errors import LayoutError, ManifestError
from ckptkit.layout.box import Box, Region
from ckptkit.engine.offline_writer import StoredTensor
from ckptkit.options import Progress
from ckptkit_converters.megatron import files as fmt
from ckptkit_converters.megatron import names, optimizer_record
from ckptkit_converters.megatron.files import MODEL, MegatronConvertResult
from ckptkit_converters.common.source_paths import regular_file
from ckptkit_converters.megatron.legacy_optimizer import read_optimizer
from ckptkit_converters.megatron.legacy_state import DISTRIB_FILE, RANK_FILE, FoundOptimizer, LegacyOptimizer, StateRef
from ckptkit_converters.megatron.import_shared import (
    ImportRun,
    RankPieces,
    check_layer_count,
    check_vocab_rows,
    import_meta,
    resolve_vocab,
    write_import,
)
from ckptkit_converters.common.renamed import divisible_by_renamed

Inventory = dict[tuple[int, int], dict[int, dict[str, tuple[tuple[int, ...], str]]]]
"""(tp rank, pp rank) -> virtual chunk -> module state-dict name -> (local shape, dtype name)."""


@dataclass(frozen=True)
class _LegacyPiece:
    ref: StateRef  # where the tensor lies: a weight at ("model<v>", name) of the rank file, or an optimizer state
    shape: tuple[int, ...]  # the TP-local tensor's (a flat optimizer state is cut and shaped so)
    rows: tuple[int, int] | None  # slice of axis 0 of the local tensor (fused part / vocab clip), or all
    layered: bool  # prepend the layer axis


class _LegacySource:
    """One legacy rank folder's pieces, read from its files (memory-mapped) when first asked for:
    ``model_optim_rng.pt`` and, for the distributed optimizer's state, ``distrib_optim.pt``."""

    def __init__(self, path: str, refs: Sequence[_LegacyPiece]) -> None:
        self._paths = {RANK_FILE: path, DISTRIB_FILE: os.path.join(os.path.dirname(path), DISTRIB_FILE)}
        self._refs = refs
        self._files: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0

    def __len__(self) -> int:
        return len(self._refs)

    def __getitem__(self, ref: int) -> torch.Tensor:
        p = self._refs[ref]
        with self._lock:
            if p.ref.file not in self._files:
                self._files[p.ref.file] = fmt.load_pt(self._paths[p.ref.file], mmap=True)
        t: Any = self._files[p.ref.file]
        for k in p.ref.path:
            t = t[k]
        if p.ref.start is not None:  # a parameter's elements of a flat distributed-optimizer state
            numel = math.prod(p.shape)
            t = t[p.ref.start:p.ref.start + numel].view(p.shape)
        if p.rows is not None:
            t = t[p.rows[0]:p.rows[1]]
        if p.layered:
            t = t.unsqueeze(0)
        self.bytes_read += t.numel() * t.element_size()
        return t.contiguous()


@dataclass(frozen=True)
class _LegacyModel:
    """What places any rank's tensor in model space, settled from all files before a piece is placed."""

    tp: int
    pp: int
    vpp: int
    layer_offset: Mapping[tuple[int, int], int]
    """(virtual chunk, stage) -> the global number of its first layer."""
    num_layers: int
    vocab_size: int
    make_vocab_size_divisible_by: int
    tied: bool
    """The output layer is the embedding: the last stage's copy is not stored."""
    ffn_local: int | None
    """A TP rank's rows of one SwiGLU part (its fc2's input), to cut a fused fc1 into gate and up."""
    single_chunk: bool
    """The files keep one ``model`` state dict (no virtual pipeline)."""

    def chunk_name(self, v: int) -> str:
        return "model" if self.single_chunk else f"model{v}"


# ---------------------------------------------------------------- 1-3: what the files hold


def _model_chunks(state: Mapping[str, Any], where: str) -> dict[int, dict[str, torch.Tensor]]:
    """The module state dicts of a rank file, by virtual chunk (``model``, or ``model0``, ``model1`` ...)."""
    if "model" in state:
        chunks = {0: state["model"]}
    else:
        chunks = {int(k[5:]): v for k, v in state.items() if k.startswith("model") and (k[5:].isascii() and k[5:].isdigit())}
    if not chunks:
        raise ManifestError(f"{where}: no 'model' (or 'model0', 'model1' ...) state dict")
    for v, sd in chunks.items():
        if not isinstance(sd, Mapping):
            raise ManifestError(f"{where}: 'model{v if len(chunks) > 1 else ''}' is not a state dict")
    return chunks


def _distrib_file(f: fmt.LegacyFile, root: str) -> str | None:
    """The ``distrib_optim.pt`` beside a rank file (a regular file inside ``root``), None if there is none."""
    path = os.path.join(os.path.dirname(f.path), DISTRIB_FILE)
    return regular_file(root, path) if os.path.lexists(path) else None


def _inventory(files: Sequence[fmt.LegacyFile], root: str, *, with_optimizer: bool
               ) -> tuple[Inventory, dict[str, Any], dict[tuple[int, int], FoundOptimizer]]:
    """Names, shapes and dtypes of every rank's chunks (memory-mapped: no tensor is read but, with
    ``with_optimizer``, the weights and main copies the optimizer's placing checks), the first file's state
    (its ``args`` and ``iteration`` speak for the checkpoint), and each file's optimizer."""
    inventory: Inventory = {}
    first: dict[str, Any] = {}
    optimizers: dict[tuple[int, int], FoundOptimizer] = {}
    for f in files:
        state = fmt.load_pt(f.path, mmap=True)
        if not isinstance(state, dict):
            raise ManifestError(f"{f.path}: expected a dict, got {type(state).__name__}")
        if not first:
            first = state
        chunks = _model_chunks(state, f.path)
        inventory[(f.tp, f.pp)] = {
            v: {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in sd.items()
                if isinstance(t, torch.Tensor)}
            for v, sd in chunks.items()}
        if with_optimizer:
            optimizers[(f.tp, f.pp)] = read_optimizer(state, chunks, f.path, _distrib_file(f, root))
        elif state.get("optimizer") is not None:
            optimizers[(f.tp, f.pp)] = FoundOptimizer(skipped="optimizer: not imported (weights_only)")
        del state, chunks
    return inventory, first, optimizers


def _layer_offsets(inventory: Inventory, pp: int, vpp: int, folder: str) -> tuple[dict[tuple[int, int], int], int]:
    """The global layer number of each (virtual chunk, stage)'s first layer, in Megatron's order
    (chunk-major), and the total: legacy files number layers within their stage and chunk."""
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
    return offset, total


def _local_ffn(inventory: Inventory) -> int | None:
    """A TP rank's share of the dense FFN size: the input size of its ``linear_fc2``."""
    fc2 = next((s for c in inventory[(0, 0)].values() for n, (s, _) in c.items()
                if n.endswith(f"{names.LINEAR_FC2}.weight")), None)
    return fc2[-1] if fc2 is not None else None


# ---------------------------------------------------------------- 4: placing one rank's tensor


def _local_tp_axis(key: str, name: str, layered: bool, model: _LegacyModel, where: str) -> int | None:
    """The axis of the TP-local tensor that TP splits (the rule's axis, without the stacked layer axis)."""
    try:
        rule = names.rule_for(key, divisible_by=model.make_vocab_size_divisible_by)
    except LayoutError as exc:
        raise LayoutError(f"{where}: tensor {name!r}: {exc}") from None
    return None if rule.tp_axis is None else rule.tp_axis - (1 if layered else 0)


def _record_spec(specs: dict[str, StoredTensor], prefix: str, key: str, name: str, shape: tuple[int, ...], dtype: str,
                 axis: int | None, layered: bool, model: _LegacyModel, where: str) -> None:
    """The model-space spec of ``key`` as this rank's tensor implies it; every rank must imply the same."""
    global_shape = list(shape)
    if axis is not None:
        global_shape[axis] *= model.tp
    wanted = {prefix + key: global_shape}
    if key in names.VOCAB_TENSORS:
        check_vocab_rows(key, global_shape[0], model.vocab_size, model.make_vocab_size_divisible_by, model.tp, where)
        if global_shape[0] > model.vocab_size:  # the padding rows, kept beside the true vocabulary
            wanted[prefix + key + names.VOCAB_PADDING_SUFFIX] = [global_shape[0] - model.vocab_size, *global_shape[1:]]
        global_shape[0] = model.vocab_size
    for out_key, out_shape in wanted.items():
        spec = StoredTensor(dtype, tuple([model.num_layers, *out_shape] if layered else out_shape))
        old = specs.setdefault(out_key, spec)
        if old != spec:
            raise ManifestError(f"{where}: tensor {name!r} ({dtype}, {list(spec.shape)} in model space) disagrees "
                                f"with other ranks ({old.dtype}, {list(old.shape)})")


def _tp_parts(key: str, shape: tuple[int, ...], axis: int | None, tp_rank: int,
              model: _LegacyModel) -> list[tuple[int, int, int]]:
    """(local row start, rows, global start along the TP axis) of each part of a TP-local tensor: one
    part, or a SwiGLU fc1's gate and up rows, which land in the two halves of the global tensor."""
    if axis is None:
        return [(0, shape[0] if shape else 0, 0)]
    ffn = model.ffn_local
    if names.is_fused_glu(key) and ffn is not None and axis == 0 and shape[0] == 2 * ffn:
        return [(0, ffn, tp_rank * ffn), (ffn, ffn, (model.tp + tp_rank) * ffn)]
    return [(0, shape[axis], tp_rank * shape[axis])]


def _part_box(key: str, shape: tuple[int, ...], axis: int | None, part: tuple[int, int, int], fused: bool,
              vocab_size: int) -> list[tuple[str, list[int], list[int], tuple[int, int] | None]]:
    """Where one part lies in the (layer-less) model-space tensor, and which rows of the local tensor
    it takes (None: all). A vocab tensor's part is cut at the true vocabulary: its real rows go to
    the tensor (suffix ``""``), its padding rows to ``<key>.vocab_padding``, as the live adapter and
    the torch_dist import store them (Megatron trains those rows: they are state)."""
    start, rows, global_start = part
    offsets, sizes = [0] * len(shape), list(shape)
    clip = None
    if axis is not None:
        offsets[axis] = global_start
        if axis == 0:
            sizes[0] = rows
            clip = (start, start + rows) if fused else None
    if axis != 0 or key not in names.VOCAB_TENSORS:
        return [("", offsets, sizes, clip)]
    real = max(0, min(global_start + shape[0], vocab_size) - global_start)
    out = []
    if real:
        out.append(("", offsets, [real, *sizes[1:]], (0, real) if real < shape[0] else None))
    if real < shape[0]:
        out.append((names.VOCAB_PADDING_SUFFIX, [global_start + real - vocab_size, *offsets[1:]],
                    [shape[0] - real, *sizes[1:]], (real, shape[0]) if real else None))
    return out


def _place_tensor(model: _LegacyModel, f: fmt.LegacyFile, v: int, name: str, shape: tuple[int, ...], dtype: str,
                  specs: dict[str, StoredTensor], prefix: str = MODEL,
                  ref: StateRef | None = None) -> list[tuple[str, Region, _LegacyPiece]]:
    """The pieces one rank's tensor stores (ckptkit key, model-space region, how to read it), its spec
    recorded. Not stored: non-tensors (``_extra_state``), a tied output layer, and TP ranks' copies of
    a replicated tensor (TP rank 0's is the one stored). ``prefix`` and ``ref``: an optimizer state of the
    weight ``name`` (stored as ``optimizer/<state>/<key>``, placed as the weight is), and where it lies."""
    mapped = names.legacy_key(name)
    if mapped is None:
        return []
    key, layer = mapped
    if key == names.OUTPUT and model.tied:
        return []
    axis = _local_tp_axis(key, name, layer is not None, model, f.path)
    if axis is None and f.tp != 0:
        return []
    _record_spec(specs, prefix, key, name, shape, dtype, axis, layer is not None, model, f.path)
    parts = _tp_parts(key, shape, axis, f.tp, model)
    out = []
    for part in parts:
        for suffix, offsets, sizes, clip in _part_box(key, shape, axis, part, len(parts) > 1, model.vocab_size):
            if layer is not None:
                offsets, sizes = [model.layer_offset[(v, f.pp)] + layer, *offsets], [1, *sizes]
            if 0 in sizes:
                continue
            out.append((prefix + key + suffix, Region(Box(tuple(offsets), tuple(sizes))),
                        _LegacyPiece(ref or StateRef(RANK_FILE, (model.chunk_name(v), name)), shape, clip,
                                     layer is not None)))
    return out


def _place_all(files: Sequence[fmt.LegacyFile], inventory: Inventory, model: _LegacyModel,
               optimizers: Mapping[tuple[int, int], LegacyOptimizer]
               ) -> tuple[dict[str, StoredTensor], RankPieces, dict[int, list[_LegacyPiece]]]:
    """Every rank's pieces (writer rank ``pp * tp + tp rank``: one per file) and how to read each: its
    weights, and the optimizer states of each weight placed as the weight is."""
    specs: dict[str, StoredTensor] = {}
    pieces: RankPieces = {}
    refs: dict[int, list[_LegacyPiece]] = {}
    for f in files:
        rank = f.pp * model.tp + f.tp
        chunks = inventory[(f.tp, f.pp)]
        placed = [_place_tensor(model, f, v, name, shape, dtype, specs)
                  for v, tensors in chunks.items() for name, (shape, dtype) in sorted(tensors.items())]
        opt = optimizers.get((f.tp, f.pp))
        for (v, name), states in sorted(opt.tensors.items()) if opt is not None else ():
            shape = chunks[v][name][0]
            placed.extend(_place_tensor(model, f, v, name, shape, "float32", specs, f"optimizer/{state}/", ref)
                          for state, ref in sorted(states.items()))
        for key, region, ref in (item for items in placed for item in items):
            pieces.setdefault(rank, []).append((key, region))
            refs.setdefault(rank, []).append(ref)
    return specs, pieces, refs


def _optimizer(found: Mapping[tuple[int, int], FoundOptimizer], folder: str, *, weights_only: bool
               ) -> tuple[dict[tuple[int, int], LegacyOptimizer], Mapping[str, Any] | None, tuple[str, ...]]:
    """Every rank file's placed optimizer, the non-tensor state the record is read from (one step in every
    file), and why a saved optimizer is not imported. All files or none: a checkpoint whose files disagree
    is refused, naming two (with ``weights_only`` nothing of the optimizer is read, so nothing is refused)."""
    placed = {tp_pp: f.optimizer for tp_pp, f in found.items() if f.optimizer is not None}
    skipped = tuple(sorted({f.skipped for f in found.values() if f.skipped is not None}))
    if weights_only:
        return {}, None, skipped
    first_of: dict[str, tuple[int, int]] = {}  # each kind of file -> the first rank folder of that kind
    for tp_pp, f in sorted(found.items()):
        first_of.setdefault("placed" if f.optimizer else "skipped" if f.skipped else "none", tp_pp)
    if len(first_of) > 1:
        (a, ka), (b, kb) = sorted(first_of.items())[:2]
        raise ManifestError(f"{folder}: the rank files disagree on the optimizer: mp_rank_{ka[0]:02d}_{ka[1]:03d} "
                            f"({a}), mp_rank_{kb[0]:02d}_{kb[1]:03d} ({b})")
    steps = sorted({o.step for o in placed.values()})
    if len(steps) > 1:
        raise ManifestError(f"{folder}: the rank files' optimizers hold different steps {steps[:4]}")
    first = placed[min(placed)].saved if placed else None
    return placed, first, skipped


# ---------------------------------------------------------------- the import


@divisible_by_renamed
def import_legacy(source: str | os.PathLike[str], dest: str | os.PathLike[str], *, vocab_size: int | None = None,
                  make_vocab_size_divisible_by: int | None = None, tied: bool | None = None, threads: int = 2,
                  weights_only: bool = False, progress: Progress | None = None,
                  storage_options: dict[str, Any] | None = None) -> MegatronConvertResult:
    """Write a legacy Megatron checkpoint as a ckptkit checkpoint: model weights, the vocabulary's padding
    rows beside them, the ``opt_param_scheduler`` state, and the optimizer's moments, main copies and step
    (the mixed-precision optimizer's, :mod:`.legacy_optimizer`; the distributed optimizer's
    ``distrib_optim.pt``, :mod:`.legacy_distrib`), so the live adapter resumes it at any layout. Listed as
    skipped, not imported: the fp32 optimizer's state (no main copies to check it by), and with
    ``weights_only`` any optimizer.

    ``source``: an ``iter_XXXXXXX`` (or ``release``) directory, or the save root
    (its ``latest_checkpointed_iteration.txt`` picks the iteration). The rank files'
    Megatron-LM ``args`` are read as for :func:`~ckptkit_converters.megatron.importer.import_torch_dist`;
    ``vocab_size`` and ``make_vocab_size_divisible_by`` are needed only where they do not record
    them (``divisible_by=``: the old keyword, one more release, with a DeprecationWarning).
    ``tied``: whether the output layer is tied to the embedding, when ``args`` does not say
    (a tied model's last stage holds a copy of the embedding, dropped here).
    """
    t0 = time.perf_counter()
    folder = fmt.resolve_legacy_dir(os.fspath(source))  # the tracker's iteration: one plain name, inside source
    files = fmt.legacy_files(folder, os.fspath(source))
    tp = max(f.tp for f in files) + 1
    pp = max(f.pp for f in files) + 1
    inventory, first, found = _inventory(files, os.fspath(source), with_optimizer=not weights_only)
    optimizers, saved_optimizer, skipped = _optimizer(found, folder, weights_only=weights_only)
    args = fmt.SavedArgs.of(first.get("args"))
    emb = inventory[(0, 0)].get(0, {}).get(names.EMBEDDING)  # stage 0, first chunk: TP-split rows
    if emb is None:
        raise ManifestError(f"{files[0].path}: no {names.EMBEDDING!r} tensor (not a Megatron GPT checkpoint?)")
    vocab_size, divisible = resolve_vocab(vocab_size, make_vocab_size_divisible_by, args, emb[0][0] * tp, folder)
    is_tied = tied if tied is not None else (not args.untied if args.untied is not None else False)
    vpp = len(inventory[(0, 0)])
    offset, total = _layer_offsets(inventory, pp, vpp, folder)
    model = _LegacyModel(tp, pp, vpp, offset, total, vocab_size, divisible, is_tied, _local_ffn(inventory),
                         single_chunk=vpp == 1 and "model" in first)
    specs, pieces, refs = _place_all(files, inventory, model, optimizers)
    check_layer_count(total, args, folder)
    dp = args.world_size // (tp * pp) if args.world_size else None
    meta = import_meta("legacy", fmt.iteration_of(first), total, vocab_size, divisible, tp, pp, dp,
                       vpp if vpp > 1 else None, is_tied,
                       optimizer=None if saved_optimizer is None else
                       optimizer_record.optimizer_record(specs, saved_optimizer, folder),
                       scheduler=optimizer_record.scheduler_record(first, files[0].path))
    paths = {f.pp * tp + f.tp: f.path for f in files}
    run = ImportRun(os.fspath(dest), folder, threads, progress, storage_options, t0)
    return write_import(run, tp * pp, specs, pieces, lambda r, _: _LegacySource(paths[r], refs.get(r, [])),
                        meta, skipped)
