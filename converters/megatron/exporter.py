"""A ckptkit Megatron checkpoint -> a Megatron ``torch_dist`` directory for a chosen ``tp``/``pp``.

``megatron.core.dist_checkpointing.load`` accepts the result for a model built
at that layout (vocab re-padded for the target tp, padding rows from the
checkpoint's ``<key>.vocab_padding`` where it has them). The DCP part is
written by DCP's own ``FileSystemWriter`` and planner functions, one virtual
rank at a time, streaming boxes from the ckptkit checkpoint. The steps: read
``megatron/meta``, check the target layout, plan every target rank's chunks
(:func:`_target_chunks`) and ``_extra_state`` items, write the directory.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptkit.errors import LayoutError, ManifestError, SaveError
from ckptkit.layout.box import Box
from ckptkit.layout.config import ParallelConfig
from ckptkit.offline.view import open as open_view
from ckptkit.engine.collective import Comm
from ckptkit.offline.spread import Dealt, agreed, same_source, spread_comm, write_then_commit
from ckptkit.options import Progress
from ckptkit_converters.megatron import files as fmt
from ckptkit_converters.megatron import extra_states, names, optimizer_export
from ckptkit_converters.megatron.files import META_KEY, MODEL, MegatronConvertResult
from ckptkit_converters.megatron.options import check_optimizer_form
from ckptkit_converters.common.failures import export_step
from ckptkit_converters.common.source_paths import local_destination
from ckptkit_converters.common.renamed import divisible_by_renamed

Chunk = tuple[int, tuple[int, ...], tuple[int, ...]]
"""One target chunk: (writer rank, offsets, sizes) in the padded global tensor."""


def _extra_state_items(keys: Sequence[str], shapes: Mapping[str, tuple[int, ...]], num_layers: int,
                       config: ParallelConfig) -> list[tuple[int, str]]:
    """The ``_extra_state`` ShardedObjects Megatron's linear layers declare, as ``(writer rank, DCP key)``.

    ``model.sharded_state_dict()`` lists one per linear module and layer
    (``decoder.layers.<module>._extra_state/shard_<layer>_<L>``), and a load
    fails on a missing one, so the export writes each: the checkpoint's payload
    where it holds one (Transformer Engine's FP8 state), else ``[None]`` (what
    Megatron saves for modules without FP8 state; TE's ``set_extra_state``
    accepts None): :func:`.extra_states.export_blob`. Routed experts declare
    one per layer and global expert: ``shard_<layer>.<expert>_<L>.<E>``.
    """
    out = []
    mesh = config.mesh()

    def writer(layer: int) -> int:
        return mesh.rank_at((config.layer_owner(layer, num_layers)[0], 0, 0, 0))

    for module in names.LINEAR_MODULES:
        if f"{names.LAYER_PREFIX}{module}.weight" in keys:
            for layer in range(num_layers):
                out.append((writer(layer), f"{names.LAYER_PREFIX}{module}._extra_state/shard_{layer}_{num_layers}"))
    for module in names.EXPERT_LINEAR_MODULES:
        key = f"{names.LAYER_PREFIX}{module}.weight"
        if key in keys:
            experts = shapes[key][1]
            for layer in range(num_layers):
                for e in range(experts):
                    out.append((writer(layer), f"{names.LAYER_PREFIX}{module}._extra_state/"
                                               f"shard_{layer}.{e}_{num_layers}.{experts}"))
    return out


class _ViewPlanner:
    """What DCP's ``FileSystemWriter.write_data`` asks of a planner: each item's tensor, read
    from the ckptkit checkpoint when the writer reaches it (vocab padding: see ``_fill_padding``)."""

    def __init__(self, view: Any, sources: Mapping[str, str], tick: Callable[[int], None]) -> None:
        self._view = view
        self._sources = sources
        self._tick = tick

    def resolve_data(self, item: Any) -> Any:
        if item.tensor_data is None:  # an _extra_state item
            return io.BytesIO(extra_states.export_blob(self._view, item.index.fqn))
        key = self._sources[item.index.fqn]
        chunk = item.tensor_data.chunk
        offs, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        shape = self._view.manifest.tensors[key].shape
        rows = min(offs[0] + sizes[0], shape[0]) - offs[0] if offs else 0
        if offs and rows < sizes[0]:  # vocab padding
            out = torch.zeros(sizes, dtype=self._view[key].dtype)
            if rows > 0:
                out[:rows] = self._view.read_box(key, Box(offs, (rows, *sizes[1:])))
            self._fill_padding(key, out, offs, rows, shape)
        else:
            out = self._view.read_box(key, Box(offs, sizes))
        dtype = item.tensor_data.properties.dtype
        if out.dtype != dtype:  # main copies taken from fp32-training weights stored in another dtype
            out = out.to(dtype)
        self._tick(out.numel() * out.element_size())
        return out


    def _fill_padding(self, key: str, out: torch.Tensor, offs: tuple[int, ...], rows: int,
                      shape: tuple[int, ...]) -> None:
        """Padding rows as the live adapter re-creates them: the saving job's padding rows where the
        checkpoint kept them (``<key>.vocab_padding``), zero past them."""
        pad_key = key + names.VOCAB_PADDING_SUFFIX
        tensors = self._view.manifest.tensors
        have = tensors[pad_key].shape[0] if pad_key in tensors else 0
        rows = max(rows, 0)
        first = max(offs[0], shape[0]) - shape[0]  # padding row index of out[rows]
        take = max(0, min(out.shape[0] - rows, have - first))
        rest = out.shape[1:]
        if take:
            out[rows:rows + take] = self._view.read_box(pad_key, Box((first, *(0,) * len(rest)), (take, *rest)))


def _expert_chunks(key: str, shape: tuple[int, ...], rule: Any, config: ParallelConfig,
                   num_layers: int) -> list[Chunk]:
    """A routed expert's tensor at the target: the pieces its rule gives each writing rank of the
    expert mesh (experts over EP, rows over ETP, layers over PP)."""
    layout = rule.evaluate(shape, config, num_layers)
    out = []
    for rank in range(config.world_size):
        coord = layout.mesh.coordinate(rank)
        held = layout.local_pieces(coord) if coord is not None and layout.is_writer(coord, 0) else None
        for _, box in (held[1] if held else []):
            if box.numel:
                out.append((rank, box.offsets, box.sizes))
    if not out:
        raise LayoutError(f"{key!r}: no rank of {config} writes it")
    return out


def _target_chunks(key: str, shape: tuple[int, ...], rule: Any, config: ParallelConfig,
                   make_vocab_size_divisible_by: int, num_layers: int) -> tuple[tuple[int, ...], list[Chunk]]:
    """The padded global shape of ``key`` at the target and its chunks ``(writer rank, offsets, sizes)``:
    each rank's part as Megatron places it (TP split per fused part, layers by pipeline chunk — uneven
    stages and virtual chunks as the target says, one chunk per virtual chunk of a stage — routed experts
    split over EP and ETP)."""
    if rule.is_expert:
        return tuple(shape), _expert_chunks(key, shape, rule, config, num_layers)
    tp, pp = config.tp, config.pp
    mesh = config.mesh()
    padded = list(shape)
    if rule.vocab_multiple is not None:
        padded[rule.tp_axis] = names.padded_vocab(shape[rule.tp_axis], make_vocab_size_divisible_by, tp)
    if rule.layer_axis is not None:
        stages, start = [], 0
        for k, n in enumerate(config.chunk_layers(num_layers)):
            if n:
                stages.append((k % pp, start, n))
            start += n
    else:
        stage = (rule.stage % pp) if rule.stage is not None else 0
        stages = [(stage, 0, 0)]
    out = []
    for p, lo, n in stages:
        for t in range(tp if rule.tp_axis is not None else 1):
            parts = rule.fused or (padded[rule.tp_axis],) if rule.tp_axis is not None else ()
            spans = []
            base = 0
            for part in parts:
                if part % tp:
                    raise LayoutError(f"{key!r}: axis {rule.tp_axis} part of {part} does not split over tp={tp}")
                spans.append((base + t * part // tp, part // tp))
                base += part
            for start, size in spans or [(None, None)]:
                offs, sizes = [0] * len(padded), list(padded)
                if start is not None:
                    offs[rule.tp_axis], sizes[rule.tp_axis] = start, size
                if rule.layer_axis is not None:
                    offs[rule.layer_axis], sizes[rule.layer_axis] = lo, n
                out.append((mesh.rank_at((p, 0, 0, t)), tuple(offs), tuple(sizes)))
    return tuple(padded), out


@dataclass
class _ExportPlan:
    """What each target rank writes (DCP ``WriteItem`` lists), which ckptkit tensor each model key
    (``keys``) and each written key, model or optimizer (``sources``), reads from, the tensor bytes
    written in all (padded vocabulary rows included: the progress total, so that it matches what
    :class:`_ViewPlanner` ticks), and the checkpoint's entries left out."""

    items: list[list[Any]]
    keys: dict[str, str] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    nbytes: int = 0
    skipped: list[str] = field(default_factory=list)
    chunks: dict[str, tuple[tuple[int, ...], list[Chunk]]] = field(default_factory=dict)
    max_memory: int | None = None
    experts: bool = False  # routed experts among the tensors: an MoE model

    def add(self, fqn: str, source: str, dtype: torch.dtype, padded: tuple[int, ...], chunks: list[Chunk]) -> None:
        """One DCP shard ``WriteItem`` per chunk of ``fqn``, on the rank that writes it, read from ``source``;
        under ``max_memory``, per slab of a chunk (:func:`split_chunk`)."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        self.sources[fqn] = source
        props = TensorProperties(dtype=dtype)
        if self.max_memory is not None:
            chunks = [c for chunk in chunks for c in split_chunk(chunk, dtype.itemsize, self.max_memory, fqn)]
        for rank, offs, sizes in chunks:
            chunk = ChunkStorageMetadata(torch.Size(offs), torch.Size(sizes))
            self.items[rank].append(WriteItem(index=MetadataIndex(fqn, offs), type=WriteItemType.SHARD,
                                              tensor_data=TensorWriteData(chunk, props, torch.Size(padded))))
            self.nbytes += math.prod(sizes) * dtype.itemsize  # what the planner ticks: padding rows included


def split_chunk(chunk: Chunk, itemsize: int, max_memory: int, fqn: str) -> list[Chunk]:
    """A target chunk as boxes of at most ``max_memory`` bytes (DCP's load reads by overlap, so Megatron's
    load of a rank's shard takes any number of stored chunks): slabs along the outermost axis longer than 1
    whose slab fits, each index of the axes outside it on its own (a chunk of stacked layers whose one layer
    is over the budget is cut layer by layer, then by rows). The smallest box is one run of the innermost
    axis; a budget below that is refused naming the tensor."""
    rank, offs, sizes = chunk
    if math.prod(sizes) * itemsize <= max_memory:
        return [chunk]
    axis = next((i for i, n in enumerate(sizes) if n > 1), len(sizes) - 1)
    row = math.prod(sizes[axis + 1:]) * itemsize
    if axis == len(sizes) - 1:
        raise LayoutError(f"tensor {fqn!r}: max_memory {max_memory} bytes cannot hold one run of {sizes[-1]} "
                          f"elements of its chunk (sizes {list(sizes)}); raise max_memory")
    step = max(1, max_memory // row)
    out: list[Chunk] = []
    for start in range(0, sizes[axis], step):
        n = min(step, sizes[axis] - start)
        part = (rank, tuple(o + start if i == axis else o for i, o in enumerate(offs)),
                tuple(n if i == axis else z for i, z in enumerate(sizes)))
        out.extend([part] if row * n <= max_memory else split_chunk(part, itemsize, max_memory, fqn))
    return out


def _read_meta(view: Any) -> dict[str, Any]:
    """The ``megatron/meta`` the import or the live adapter wrote: without it the layers, vocabulary and
    padding multiple are unknown, so the source is not a ckptkit Megatron checkpoint."""
    if META_KEY not in view.values:
        raise ManifestError(f"{view.url}: no {META_KEY!r} value: not a ckptkit Megatron checkpoint")
    return json.loads(view.values[META_KEY])


def _target_layout(num_layers: int, tp: int, pp: int, ep: int, etp: int | None, vpp: int,
                   pp_layers: Sequence[int] | None) -> ParallelConfig:
    """The target layout, refused unless its pipeline chunks hold the model's layers (an even split over
    ``pp * vpp`` chunks, or ``pp_layers`` counts that sum to them)."""
    if tp < 1 or pp < 1 or vpp < 1:
        raise LayoutError(f"cannot export at tp={tp} pp={pp} vpp={vpp}: degrees must be positive")
    config = ParallelConfig.parse(f"tp{tp}pp{pp}ep{ep}" + (f"etp{etp}" if etp is not None else ""))
    config = dataclasses.replace(config, vpp=vpp, pp_layers=tuple(pp_layers) if pp_layers is not None else None)
    try:
        config.chunk_layers(num_layers)
    except LayoutError as exc:
        raise LayoutError(f"cannot export {num_layers} layers at {config}: {exc}") from exc
    return config


def _empty_destination(dest: str | os.PathLike[str]) -> str:
    """``dest``, refused when it holds anything: an export writes a whole new directory, and a failed
    one removes it."""
    out = local_destination(dest, "the Megatron torch_dist export")
    if os.path.exists(out) and os.listdir(out):
        raise SaveError(f"{out} is not empty; an export writes a new torch_dist directory")
    return out


def _plan_tensors(view: Any, config: ParallelConfig, make_vocab_size_divisible_by: int,
                  num_layers: int, max_memory: int | None = None) -> _ExportPlan:
    """A DCP shard ``WriteItem`` per target chunk (or slab of one, under ``max_memory``) of every model
    tensor, on the rank that writes it."""
    plan = _ExportPlan([[] for _ in range(config.world_size)], max_memory=max_memory)
    for key, tmeta in sorted(view.manifest.tensors.items()):
        if not key.startswith(MODEL):
            plan.skipped.append(key)
            continue
        if key.endswith(names.VOCAB_PADDING_SUFFIX):  # the saving job's padding rows: written inside the vocab tensor
            continue
        mkey = key[len(MODEL):]
        rule = tmeta.rule or names.rule_for(mkey, divisible_by=make_vocab_size_divisible_by)
        if rule.layer is not None:
            raise LayoutError(f"{view.url}: {mkey!r} is a per-layer tensor (an MoE layer pattern); the torch_dist "
                              "export writes stacked layers only")
        padded, chunks = _target_chunks(mkey, tmeta.shape, rule, config, make_vocab_size_divisible_by, num_layers)
        plan.experts = plan.experts or rule.is_expert
        plan.keys[mkey] = key
        plan.chunks[mkey] = (padded, chunks)
        plan.add(mkey, key, view[key].dtype, padded, chunks)
    return plan


def _plan_optimizer(view: Any, plan: _ExportPlan, record: Mapping[str, Any], form: str) -> None:
    """The optimizer's tensors (see :mod:`.optimizer_export`): each split exactly as its model tensor,
    in fp32 as Megatron's optimizers (distributed or plain) hold them."""
    sources = optimizer_export.state_sources(record, plan.keys, view.manifest.tensors, view.url, form)
    for fqn, source in sources.items():
        mkey = fqn.split(".", 3)[3]
        padded, chunks = plan.chunks[mkey]
        plan.add(fqn, source, torch.float32, padded, chunks)
    used = set(sources.values())
    plan.skipped = [k for k in plan.skipped if k not in used and k.removesuffix(names.VOCAB_PADDING_SUFFIX) not in used]


def _plan_extra_states(view: Any, plan: _ExportPlan, config: ParallelConfig, num_layers: int) -> None:
    """A bytes ``WriteItem`` per ``_extra_state`` Megatron's load asks for (see :func:`_extra_state_items`)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    shapes = {k: view.manifest.tensors[v].shape for k, v in plan.keys.items()}
    written = set()
    for rank, item_key in _extra_state_items(list(plan.keys), shapes, num_layers, config):
        plan.items[rank].append(WriteItem(index=MetadataIndex(item_key), type=WriteItemType.BYTE_IO))
        written.add(extra_states.PREFIX + item_key)
    plan.skipped = [k for k in plan.skipped if k not in written]  # payloads no item asks for stay listed


def _write_directory(view: Any, out: str, plan: _ExportPlan, common: dict[str, Any], comm: Comm | None,
                     progress: Progress | None) -> None:
    """Write the plan with DCP's own ``FileSystemWriter`` (one virtual rank at a time), then ``common.pt``
    and ``metadata.json``, and ``.metadata`` last (DCP's commit). On any failure the directory is removed;
    a failure that is not ckptkit's own becomes a :class:`SaveError` naming the export.

    Spread (``comm``): every process makes the same global plan, writes the files of its share of the
    virtual ranks, and sends what DCP's writer reported for them to process 0 as JSON, which writes
    ``common.pt``, ``metadata.json`` and ``.metadata``; a failure anywhere fails every process and
    process 0 removes the directory."""
    what = f"exporting {view.url} to torch_dist at {out}"
    try:
        writer, global_plans, metadata = agreed(comm, lambda: export_step(lambda: _set_up(out, plan), SaveError, what))
    except BaseException:
        if comm is None or comm.rank == 0:
            shutil.rmtree(out, ignore_errors=True)
        raise
    sizes = {i: sum(math.prod(w.tensor_data.chunk.sizes) * w.tensor_data.properties.dtype.itemsize
                    for w in items if w.tensor_data is not None) for i, items in enumerate(plan.items)}
    dealt = Dealt(comm, sizes, len(global_plans), progress, plan.nbytes, "megatron-export")
    planner = _ViewPlanner(view, plan.sources, dealt.tick)

    def write(mine: list[int]) -> dict[int, list[Any]]:
        return export_step(lambda: {i: [_result_json(r) for r in writer.write_data(global_plans[i], planner).wait()]
                                    for i in mine}, SaveError, what)

    def commit(parts: list[dict[Any, list[Any]]]) -> None:
        results = {int(i): [_result(r) for r in rs] for part in parts for i, rs in part.items()}
        export_step(lambda: _finish(writer, out, common, metadata, [results[i] for i in range(len(global_plans))]),
                    SaveError, what)

    write_then_commit(comm, dealt, write, commit, lambda: shutil.rmtree(out, ignore_errors=True))


def _set_up(out: str, plan: _ExportPlan) -> tuple[Any, list[Any], Any]:
    """DCP's writer and its global plan for ``plan`` (the same on every process: a pure function of it)."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
    from torch.distributed.checkpoint.planner import SavePlan

    os.makedirs(out, exist_ok=True)
    writer = FileSystemWriter(out, single_file_per_rank=True, thread_count=1, overwrite=False)
    writer.set_up_storage_writer(True)
    local = [writer.prepare_local_plan(SavePlan(items)) for items in plan.items]
    global_plans, metadata = create_default_global_save_plan(local)
    return writer, writer.prepare_global_plan(global_plans), metadata


def _finish(writer: Any, out: str, common: dict[str, Any], metadata: Any, results: list[Any]) -> None:
    torch.save(common, os.path.join(out, fmt.COMMON_NAME))
    with open(os.path.join(out, fmt.CONFIG_NAME), "w", encoding="utf-8") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}, f)
    writer.finish(metadata, results)  # .metadata last: DCP's commit


def _result_json(r: Any) -> list[Any]:
    """What DCP's writer reported for one written item, as JSON (a spread export's processes send it)."""
    i, info = r.index, r.storage_data
    return [i.fqn, None if i.offset is None else list(i.offset), i.index, r.size_in_bytes, info.relative_path,
            info.offset, info.length, info.transform_descriptors]


def _result(doc: list[Any]) -> Any:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    fqn, offset, index, size, path, at, length, transforms = doc
    return WriteResult(index=MetadataIndex(fqn, None if offset is None else torch.Size(offset), index),
                       size_in_bytes=size, storage_data=_StorageInfo(path, at, length, transform_descriptors=transforms))


def _common(meta: Mapping[str, Any], optimizer: Any) -> dict[str, Any]:
    """``common.pt``: what Megatron-LM's ``load_checkpoint`` reads beside the tensors (no ``args``: it
    then keeps its command-line arguments)."""
    out: dict[str, Any] = {"iteration": int(meta.get("iteration", 0)), "checkpoint_version": 3.0,
                           "content_metadata": dict(optimizer_export.CONTENT_METADATA)}
    if meta.get("scheduler") is not None:
        out["opt_param_scheduler"] = meta["scheduler"]
    if optimizer is not None:
        out["optimizer"] = optimizer
    return out


@divisible_by_renamed
def export_torch_dist(source: str | os.PathLike[str], dest: str | os.PathLike[str], *, tp: int, pp: int,
                      ep: int = 1, etp: int | None = None, vpp: int = 1, pp_layers: Sequence[int] | None = None,
                      make_vocab_size_divisible_by: int | None = None, weights_only: bool = False,
                      progress: Progress | None = None, optimizer: str = "distributed",
                      process_group: Any = None, max_memory: int | None = None) -> MegatronConvertResult:
    """Write the ckptkit Megatron checkpoint ``source`` as a torch_dist directory for ``tp``/``pp``
    (and, for an MoE model, ``ep`` / ``etp``: routed experts are written as the expert ranks hold them;
    ``vpp`` / ``pp_layers``: virtual pipeline chunks and uneven stages, as in :class:`ParallelConfig`, each
    rank writing the layers its chunks hold).

    ``megatron.core.dist_checkpointing.load(model.sharded_state_dict(), dest)``
    accepts it for a model built at that layout (any layout, in fact: DCP reads
    by overlap; ``tp`` fixes the padded vocab). ``make_vocab_size_divisible_by``: the padding
    multiple to re-pad the vocabulary to (None: the checkpoint's; ``divisible_by=``: the old
    keyword, one more release, with a DeprecationWarning).

    With the optimizer (the default, when the checkpoint holds one): the distributed optimizer's
    state in its ``fully_reshardable`` form, the LR scheduler (``opt_param_scheduler``) and the
    loss scaler, so that Megatron resumes model and optimizer at any layout
    (:mod:`.optimizer_export`); ``optimizer="plain"``: the plain optimizer's state instead, for a job run
    without ``--use-distributed-optimizer``; ``weights_only``: the model (and scheduler) alone. ``common.pt``
    holds ``iteration``, ``checkpoint_version`` and ``content_metadata`` (no ``args``: Megatron-LM
    then keeps its command-line arguments). Memory: one target chunk at a time (DCP's writer on CPU
    resolves and writes a file's items one by one), the largest a whole tensor at tp 1;
    ``max_memory``: every chunk larger than that many bytes is written as slabs of rows, each its own DCP
    chunk (Megatron's load reads by overlap). ``process_group`` (a ``torchrun`` job's; call on
    every process with the same arguments): the target ranks' files are spread over its processes
    (:func:`_write_directory`); the same files as one process writes.
    """
    check_optimizer_form(optimizer)  # before anything is opened or written
    t0 = time.perf_counter()
    comm = spread_comm(process_group)

    def prepare() -> tuple[Any, dict[str, Any], ParallelConfig, str, _ExportPlan, Any, Any]:
        view = open_view(source)
        meta = _read_meta(view)
        divisible = make_vocab_size_divisible_by or meta["make_vocab_size_divisible_by"]
        num_layers = int(meta["num_layers"])
        config = _target_layout(num_layers, tp, pp, ep, etp, vpp, pp_layers)
        out = _empty_destination(dest)
        if max_memory is not None and max_memory < 1:
            raise LayoutError(f"max_memory must be a positive number of bytes, got {max_memory}")
        plan = _plan_tensors(view, config, divisible, num_layers, max_memory)
        record = None if weights_only else meta.get("optimizer")
        common_entry = None
        if record is not None:
            optimizer_export.check_optimizer_count(record, plan.experts, config.ep, view.url)
            common_entry = optimizer_export.optimizer_common(record, view.url, optimizer)
            _plan_optimizer(view, plan, record, optimizer)
        _plan_extra_states(view, plan, config, num_layers)
        return view, meta, config, out, plan, record, common_entry

    view, meta, config, out, plan, record, common_entry = agreed(comm, prepare)
    same_source(comm, view.url, view.manifest.attempt)
    num_layers = int(meta["num_layers"])
    _write_directory(view, out, plan, _common(meta, common_entry), comm, progress)
    out_meta = {**meta, "layout": {"tp": tp, "pp": pp, "dp": None, "vpp": vpp, "ep": ep,
                                   "etp": config.expert_tp, "pp_layers": list(config.chunk_layers(num_layers))},
                "optimizer": record}
    return MegatronConvertResult(view.url, out, "megatron-torch_dist", len(plan.keys), plan.nbytes, view.bytes_read,
                                 time.perf_counter() - t0, out_meta, tuple(plan.skipped))
