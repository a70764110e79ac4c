"""A native DeepSpeed ZeRO folder -> a committed ckptkit checkpoint of :mod:`ckptkit.adapters.deepspeed`.

``engine.save_checkpoint`` writes ``latest`` + ``global_stepN/`` (:mod:`ckptkit_converters.deepspeed.files`
says which file holds what). The import writes the checkpoint ``ckptkit.adapters.deepspeed.load``
resumes at any DP size and ZeRO stage: each native DP rank becomes a virtual writer rank that stores
the flat fragments of its own optimizer file — no re-partitioning, no gather — so files are read one
rank at a time (:mod:`ckptkit.engine.offline_writer`), through the allow-list unpickler only.

The steps, in order: read the model-states file and rank 0's optimizer file, check that the module
holds exactly what ``param_shapes``, ``buffer_names``, ``frozen_param_shapes`` and ``shared_params``
name (DeepSpeed's strict load refuses anything else), and derive the flat layout they imply
(:class:`NativeZero`); take the optimizer's state kinds and per-group scalars;
describe every stored tensor and which rank stores which piece of it; check each rank's file against
the layout as it is read; write, with the adapter's record built by the builder the live adapter
uses. DeepSpeed-MoE folders go through the same steps with the experts stacked in model space
(:mod:`ckptkit_converters.deepspeed.moe`); MoE folders saved without ZeRO (``expp_rank_*``) through
:mod:`ckptkit_converters.deepspeed.expp`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from math import prod
from dataclasses import dataclass
from typing import Any

import torch

from ckptkit.adapters.deepspeed import FP32, Space, model_key, optim_key
from ckptkit.adapters.deepspeed_record import RecordSources, SavedLayout
from ckptkit.engine.offline_writer import ConvertResult, OfflineWriteOptions, StoredTensor, write_offline
from ckptkit.engine.state import dtype_name
from ckptkit.errors import CoverageError, LayoutError, ManifestError
from ckptkit.layout.box import Box, Region
from ckptkit.layout.strict_json import MAX_LAYOUT_INT
from ckptkit.layout.values import encode_value
from ckptkit.layout.zero_partition import Zero3SubGroup, param_alignment, zero3_partition_numel
from ckptkit.options import Progress
from ckptkit.storage.url import open_store
from ckptkit_converters.deepspeed import files as fmt
from ckptkit_converters.deepspeed import moe as dsm
from ckptkit_converters.deepspeed.flat_layout import DEFAULT_SUB_GROUP_SIZE, FlatLayout, flat_layouts
from ckptkit_converters.deepspeed.record import META_KEY, native_count, native_record, shared_params

RankData = dict[str, Any]
"""One rank's checked contents: ``fp32`` (flat partition per flat group) and ``state`` from its optimizer
file, and at ZeRO 3 ``frozen`` (its partition of each frozen parameter) from its model-states file."""
Getter = Callable[[RankData], torch.Tensor]


@dataclass(frozen=True)
class NativeZero:
    """What a native ZeRO folder's model-states file and rank 0's optimizer file say: the files, the
    module state, the parameter shapes per param group, rank 0's records, the MoE facts (None: dense),
    the flat layout they imply, the training dtype and the frozen parameters (:func:`check_module`)."""

    files: fmt.NativeFiles
    model0: dict[str, Any]
    module: dict[str, Any]
    shapes: list[dict[str, tuple[int, ...]]]
    optim0: dict[str, Any]
    base0: dict[str, Any]
    moe: dsm.NativeMoE | None
    layouts: list[FlatLayout]
    lp_dtype: torch.dtype
    frozen: list[str]

    @property
    def where(self) -> str:
        return self.files.model[0]

    @property
    def tag_dir(self) -> str:
        return os.path.join(self.files.folder, self.files.tag)

    def group_rank(self, k: int, r: int) -> int:
        """The partition of flat group ``k`` that DP rank ``r`` holds (an expert group is cut over its
        expert-data-parallel group, so several ranks hold the same partition of different experts)."""
        return r if self.moe is None else self.moe.group_rank(self.layouts[k].group, r)

    def space(self, k: int, r: int, i: int) -> Space:
        """Where member ``i`` of flat group ``k`` on DP rank ``r`` sits in model space."""
        lay = self.layouts[k]
        if self.moe is None:
            return Space.whole(lay.names[i], lay.shapes[i])
        return self.moe.space(lay.group, r, lay.names[i], lay.shapes[i])


@dataclass(frozen=True)
class StoredTensors:
    """Every tensor the checkpoint stores (``specs``), the model-space members of each flat group in
    order, and the module tensors outside the optimizer: buffers and frozen parameters."""

    specs: dict[str, StoredTensor]
    members: list[dict[str, None]]
    buffers: list[str]
    frozen: list[str]


def import_deepspeed(source: str | os.PathLike[str], dest: str | os.PathLike[str], *, tag: str | None = None,
                     options: OfflineWriteOptions = OfflineWriteOptions(threads=1),
                     storage_options: dict[str, Any] | None = None,
                     progress: Progress | None = None) -> ConvertResult:
    """Write the native DeepSpeed checkpoint ``source`` (tag ``tag``, default ``latest``) as a ckptkit
    checkpoint at ``dest``. Memory holds about ``options.threads`` ranks' optimizer files at a time.
    ``progress(done, total)``: bytes of tensors written, reported by the offline writer as it goes."""
    t0 = time.perf_counter()
    from ckptkit_converters.deepspeed import expp as deepspeed_expp

    # one plain name, from the option or 'latest', naming a folder that exists (else the error names 'latest')
    tag, where = fmt.resolve_tag(os.fspath(source), tag)
    if deepspeed_expp.expp_files(os.fspath(source), where):  # MoE without ZeRO
        return deepspeed_expp.import_expp(os.fspath(source), tag, dest, options=options,
                                          storage_options=storage_options, progress=progress)
    native = read_native(fmt.find_files(os.fspath(source), tag))
    keys, scalars = optimizer_state_kinds(native)
    stored = stored_tensors(native, keys)
    pieces, getters = rank_pieces(native, keys, stored)
    meta, skipped = native_record(native.model0, _saved_layout(native, stored, keys, scalars),
                                  native.base0["param_groups"], RecordSources(native.where, native.files.optim[0]))
    files = native.files
    out = open_store(dest, storage_options)
    result = write_offline(
        out, world_size=files.dp, tensors=stored.specs, pieces=pieces,
        source=lambda r, _: _RankSource(native, keys, getters[r], r),
        values={META_KEY: encode_value(json.dumps(meta), META_KEY)},
        meta={"user": {}, "converted_from": {"url": native.tag_dir, "format": "deepspeed",
                                             "stage": files.zero_stage, "dp": files.dp,
                                             "skipped_client_state": skipped}},
        parallel=f"dp{files.dp}", options=options, progress=progress,
        what=f"importing {files.folder}/{files.tag} into {out.url}",
        layouts=None if native.moe is None else dsm.layouts_with_rules(
            stored.specs, pieces, {k for k in stored.specs if k.split("/", 2)[-1] in meta["experts"]}))
    return ConvertResult(native.tag_dir, out.url, "ckptkit", len(stored.specs), result.nbytes,
                         result.bytes_read, time.perf_counter() - t0)


def read_native(files: fmt.NativeFiles) -> NativeZero:
    """The model-states file and rank 0's optimizer file, checked, and the flat layout they imply —
    everything the import needs before it reads any other rank."""
    model0 = fmt.load_file(files.model[0])
    where = files.model[0]
    shapes = fmt.param_shapes(model0, where)
    ds_config = model0.get("ds_config") or {}
    zcfg = (ds_config.get("zero_optimization") if isinstance(ds_config, dict) else None) or {}
    module = model0.get("module") or {}
    if not isinstance(zcfg, dict) or not isinstance(module, dict):
        raise ManifestError(f"{where}: 'module' must be a state dict and ds_config['zero_optimization'] a dict")
    _check_world_size(files, model0)
    first = next((n for g in shapes for n in g), None)
    if first is None or not isinstance(module.get(first), torch.Tensor):
        raise ManifestError(f"{where}: module state has no tensor for the first parameter {first!r} of param_shapes")
    optim0 = fmt.optimizer_record(fmt.load_file(files.optim[0]), files.optim[0])
    base0 = fmt.base_optimizer_state(optim0, files.zero_stage, files.optim[0])
    tag_dir = os.path.join(files.folder, files.tag)
    moe = dsm.native_moe(files.folder, tag_dir, model0, shapes, optim0, base0["param_groups"], files.dp,
                         files.zero_stage, where)
    lp_dtype = module[first].dtype
    frozen = check_module(files, model0, module, shapes, moe is not None, lp_dtype)
    layouts = _native_layouts(files, shapes, moe, _native_cut(zcfg, lp_dtype, where))
    return NativeZero(files, model0, module, shapes, optim0, base0, moe, layouts, lp_dtype, frozen)


def _check_world_size(files: fmt.NativeFiles, model0: dict[str, Any]) -> None:
    """The DP size the model-states file records must be the number of rank files found: fewer files
    means some were lost (named, so the user knows which to restore), more that the folder mixes runs."""
    where = files.model[0]
    saved = native_count(model0, "dp_world_size", where, files.dp, minimum=1)
    if saved > files.dp:
        tag_dir = os.path.join(files.folder, files.tag)
        prefix = "bf16_" if os.path.basename(files.optim[0]).startswith("bf16_") else ""
        missing = [os.path.join(tag_dir, fmt.optim_file_name(r, prefix)) for r in range(files.dp, saved)]
        if files.zero_stage == 3:
            missing += [os.path.join(tag_dir, fmt.model3_file_name(r)) for r in range(files.dp, saved)]
        raise CoverageError(f"{', '.join(missing)}: missing: {where} records dp_world_size {saved}, and only "
                            f"DP ranks 0..{files.dp - 1} have files in {tag_dir}")
    if saved != files.dp:
        raise ManifestError(f"{where}: dp_world_size {saved} but {files.dp} optimizer files")


def check_module(files: fmt.NativeFiles, model0: dict[str, Any], module: dict[str, Any],
                 shapes: list[dict[str, tuple[int, ...]]], moe: bool, lp_dtype: torch.dtype) -> list[str]:
    """``module`` must hold exactly what DeepSpeed's strict ``load_checkpoint`` would load: a tensor for
    every parameter ``param_shapes`` lists (routed experts live in their own files), buffer and frozen
    parameter, and nothing else but tied aliases. Checked before anything is written: a missing
    parameter would otherwise fail mid-write, and an unknown weight be dropped without a word.

    Returns the frozen parameters' names. ZeRO 1 records none (DeepSpeed writes ``frozen_param_shapes``
    only when it partitions gradients, stage 2 and up), while its ``module`` holds every parameter whole:
    there a module tensor no table lists is a frozen parameter, imported as one, under its own name and
    with its own bytes. At ZeRO 2 and 3 such a tensor is refused."""
    where = files.model[0]
    tables: dict[str, list[str]] = {
        "param_shapes": [n for g in shapes for n in g if not (moe and dsm.split_expert_name(n) is not None)]}
    for table in ("buffer_names", "frozen_param_shapes"):
        names = model0.get(table) or []
        if not isinstance(names, (list, tuple, dict)) or not all(isinstance(n, str) for n in names):
            raise ManifestError(f"{where}: {table} is {type(names).__name__}; expected the names of module tensors")
        tables[table] = list(names)
    for table, names in tables.items():
        for n in names:
            t = module.get(n)
            if not isinstance(t, torch.Tensor):
                raise ManifestError(f"{where}: module state has no tensor for {n!r}, which {table} lists (found "
                                    f"{type(t).__name__ if n in module else 'no entry'})")
    for n in tables["param_shapes"] if files.zero_stage < 3 else []:  # ZeRO 3 keeps empty placeholders
        if module[n].dtype != lp_dtype or tuple(module[n].shape) != _shape_of(shapes, n):
            raise ManifestError(f"{where}: module tensor {n!r} is {module[n].dtype} {list(module[n].shape)}; "
                                f"param_shapes and the training dtype give {lp_dtype} {list(_shape_of(shapes, n))}")
    known = {n for names in tables.values() for n in names} | set(shared_params(model0, where))
    extra = [k for k in module if k not in known]
    if extra and files.zero_stage == 1:
        odd = [k for k in extra if not isinstance(module[k], torch.Tensor)]
        if odd:
            raise ManifestError(f"{where}: module state entry {odd[0]!r} is {type(module[odd[0]]).__name__}; a "
                                "ZeRO-1 module entry no table lists must be a frozen parameter's tensor")
        return tables["frozen_param_shapes"] + extra
    if extra:
        raise ManifestError(f"{where}: module state holds {extra[:8]!r}, which neither param_shapes, buffer_names, "
                            f"frozen_param_shapes nor shared_params lists; DeepSpeed's strict load_checkpoint "
                            f"refuses such a weight, and the import will not drop it")
    return tables["frozen_param_shapes"]


def _shape_of(shapes: list[dict[str, tuple[int, ...]]], name: str) -> tuple[int, ...]:
    return next(g[name] for g in shapes if name in g)


def _native_cut(zcfg: dict[str, Any], lp_dtype: torch.dtype, where: str) -> dict[str, Any]:
    """How the saving engine cut its flat buffers, from ``ds_config['zero_optimization']``: the files
    do not record it, and a wrong guess would misplace every fragment (checked against each file)."""
    return {"round_robin": bool(zcfg.get("round_robin_gradients")),
            "align": param_alignment(torch.tensor([], dtype=lp_dtype).element_size(),
                                     bool(zcfg.get("parameter_alignment"))),
            "sub_group_size": native_count(zcfg, "sub_group_size", f"{where}: ds_config['zero_optimization']",
                                           DEFAULT_SUB_GROUP_SIZE, minimum=1)}


def _native_layouts(files: fmt.NativeFiles, shapes: list[dict[str, tuple[int, ...]]], moe: dsm.NativeMoE | None,
                    cut: dict[str, Any]) -> list[FlatLayout]:
    """The flat partitions of the saving engine: every param group over the whole DP group, except an
    expert group, which ZeRO 1/2 cut over its expert-data-parallel group (one flat partition each)."""
    if moe is None:
        return flat_layouts([list(g.items()) for g in shapes], files.zero_stage, files.dp, **cut)
    return [FlatLayout(g, lay.names, lay.shapes, lay.cut) for g, members in enumerate(shapes)
            for lay in flat_layouts([list(members.items())], files.zero_stage, moe.group_dp(g), **cut)]


def optimizer_state_kinds(native: NativeZero) -> tuple[list[str], list[dict[str, Any]]]:
    """The partition-shaped state tensors every flat group holds (Adam's ``exp_avg``, ``exp_avg_sq``),
    and each group's scalar states (``step``), from rank 0's file: the adapter stores one set of
    state kinds for the whole optimizer and one scalar record per flat group."""
    path, state = native.files.optim[0], native.base0["state"]
    if len(state) != len(native.layouts):
        raise ManifestError(f"{path}: optimizer state for {len(state)} flat groups, the "
                            f"parameter groups give {len(native.layouts)}")
    state_keys, scalars = [], []
    for k in range(len(native.layouts)):
        st = state.get(k, {})
        if not isinstance(st, dict):
            raise ManifestError(f"{path}: optimizer state of flat group {k} is not a dict")
        flat = {key for key, v in st.items() if isinstance(v, torch.Tensor) and v.dim() == 1}
        state_keys.append(sorted(flat))
        scalars.append({key: fmt.scalar(v, f"{path}: optimizer state {key!r} of flat group {k}")
                        for key, v in st.items() if key not in flat})
        fmt.check_step(scalars[-1], f"{path}: flat group {k}")
    keys = sorted(set(state_keys[0]))
    if any(sorted(set(s)) != keys for s in state_keys):
        raise ManifestError(f"{path}: flat groups hold different optimizer state keys {state_keys}")
    return keys, scalars


def stored_tensors(native: NativeZero, keys: Sequence[str]) -> StoredTensors:
    """Every tensor the checkpoint will hold: per model-space parameter its fp32 master, each state kind
    and its training-dtype weight; and the buffers and frozen parameters of the module, as they are."""
    specs: dict[str, StoredTensor] = {}
    members: list[dict[str, None]] = [{} for _ in native.layouts]  # model-space names per flat group, in order
    lp = dtype_name(native.lp_dtype)
    for k, lay in enumerate(native.layouts):
        for r in range(1 if native.moe is None else max(native.moe.group_ep)):  # EP ranks 0..ep-1 hold every expert
            for i in range(len(lay.names)):
                sp = native.space(k, r, i)
                members[k][sp.name] = None
                specs[optim_key(FP32, sp.name)] = StoredTensor("float32", sp.shape)
                for key in keys:
                    specs[optim_key(key, sp.name)] = StoredTensor("float32", sp.shape)
                specs[model_key(sp.name)] = StoredTensor(lp, sp.shape)
    buffers = list(native.model0.get("buffer_names") or [])
    frozen = list(native.frozen)
    zero3 = native.files.zero_stage == 3  # its module holds empty placeholders for frozen parameters
    for n in buffers if zero3 else [*buffers, *frozen]:
        if n not in native.module:
            raise ManifestError(f"{native.where}: module state has no entry for {n!r}")
        specs[model_key(n)] = StoredTensor(dtype_name(native.module[n].dtype), tuple(native.module[n].shape))
    for n, (shape, dtype) in (frozen3_specs(native) if zero3 else {}).items():  # shape and dtype from the lists
        specs[model_key(n)] = StoredTensor(dtype_name(dtype), shape)
    return StoredTensors(specs, members, buffers, frozen)


def frozen3_specs(native: NativeZero) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each frozen parameter of a ZeRO-3 folder: its whole shape (``frozen_param_shapes``) and dtype (rank
    0's fragment in ``frozen_param_fragments``), checked: every rank's fragment is that partition's size."""
    where = native.where
    shapes = native.model0.get("frozen_param_shapes") or {}
    fragments = native.model0.get("frozen_param_fragments") or {}
    out = {}
    for n in native.frozen:
        shape, frag = shapes.get(n), fragments.get(n)
        if not isinstance(shape, (tuple, list)) or not all(type(d) is int and 0 <= d <= MAX_LAYOUT_INT
                                                              for d in shape):
            raise ManifestError(f"{where}: frozen_param_shapes[{n!r}] is {shape!r}; expected a shape")
        if not isinstance(frag, torch.Tensor):
            raise ManifestError(f"{where}: frozen_param_fragments has no tensor for the frozen parameter {n!r}")
        out[n] = (tuple(shape), frag.dtype)
    return out


def frozen3_fragments(native: NativeZero, r: int, model: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Rank ``r``'s ZeRO-3 partition of every frozen parameter (from its model-states file ``model``),
    checked: a tensor of the partition's padded size ``ceil(numel / dp)`` and the parameter's dtype."""
    where = native.files.model[r]
    fragments = model.get("frozen_param_fragments") or {}
    out = {}
    for n, (shape, dtype) in frozen3_specs(native).items():
        t = fragments.get(n) if isinstance(fragments, dict) else None
        want = zero3_partition_numel(prod(shape), native.files.dp)
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.numel() != want:
            got = f"{t.dtype} with {t.numel()} elements" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ManifestError(f"{where}: frozen_param_fragments[{n!r}] is {got}; the ZeRO-3 partition of "
                                f"{list(shape)} at DP {native.files.dp} is {dtype} with {want} elements")
        out[n] = t.reshape(-1)
    return out


def rank_pieces(native: NativeZero, keys: Sequence[str], stored: StoredTensors
                ) -> tuple[dict[int, list[tuple[str, Region]]], dict[int, list[Getter]]]:
    """Which pieces each virtual rank stores, in write order, and how to get each from the rank's data:
    rank ``r`` its own fragments; rank 0 also the whole module tensors (ZeRO 1/2), buffers, frozen
    parameters and the routed experts' training-dtype weights."""
    pieces: dict[int, list[tuple[str, Region]]] = {}
    getters: dict[int, list[Getter]] = {}
    for r in range(native.files.dp):
        pieces[r], getters[r] = _fragment_pieces(native, keys, r)
    zero_stage, moe = native.files.zero_stage, native.moe
    dense = [] if zero_stage == 3 else [n for lay in native.layouts for n in lay.names
                                        if moe is None or dsm.split_expert_name(n) is None]
    specs, module = stored.specs, native.module
    whole = stored.frozen if zero_stage < 3 else []
    for n in dense + stored.buffers + whole:
        pieces[0].append((model_key(n), Region(Box.full(specs[model_key(n)].shape))))
        getters[0].append(lambda d, n=n: module[n].reshape(specs[model_key(n)].shape))
    if zero_stage == 3:  # frozen parameters: each rank its partition, from its own model-states file
        for n in stored.frozen:
            shape = specs[model_key(n)].shape
            sub = Zero3SubGroup((prod(shape),), native.files.dp)
            for r in range(native.files.dp):
                f = sub.param_fragment(0, r)
                if f is not None:
                    pieces[r].append((model_key(n), Region(Box.full(shape), (f.start, f.stop))))
                    getters[r].append(lambda d, n=n, k=f.numel: d["frozen"][n][:k])
    if moe is not None:  # routed experts in the training dtype: from the per-expert files, each expert's box
        experts = dsm.ExpertFiles(native.files.folder, native.tag_dir, moe)
        for stacked, box, layer, e, local_key in experts.boxes(native.shapes):
            pieces[0].append((model_key(stacked), Region(box)))
            getters[0].append(lambda d, layer=layer, e=e, local_key=local_key, box=box:
                              experts.tensor(layer, e, local_key).reshape(box.sizes))
    return pieces, getters


def _fragment_pieces(native: NativeZero, keys: Sequence[str],
                     r: int) -> tuple[list[tuple[str, Region]], list[Getter]]:
    """Rank ``r``'s own fragments: of the fp32 masters and each state kind, and at ZeRO 3 of the
    training-dtype weights too (native ZeRO-3 stores no such partitions: derived as DeepSpeed does)."""
    items: list[tuple[str, Region]] = []
    gets: list[Getter] = []
    lp_dtype = native.lp_dtype
    for k, lay in enumerate(native.layouts):
        for f in lay.fragments(native.group_rank(k, r)):
            sp = native.space(k, r, f.param)
            name, region = sp.name, Region(sp.box, (f.start, f.stop))
            a, b = f.local_start, f.local_start + f.numel
            items.append((optim_key(FP32, name), region))
            gets.append(lambda d, k=k, a=a, b=b: d["fp32"][k][a:b])
            for key in keys:
                items.append((optim_key(key, name), region))
                gets.append(lambda d, k=k, a=a, b=b, key=key: d["state"][k][key][a:b])
            if native.files.zero_stage == 3:
                items.append((model_key(name), region))
                gets.append(lambda d, k=k, a=a, b=b: d["fp32"][k][a:b].to(lp_dtype))
    return items, gets


def _saved_layout(native: NativeZero, stored: StoredTensors, keys: list[str],
                  scalars: list[dict[str, Any]]) -> SavedLayout:
    """The layout part of the adapter's record, as a live save of the same engine would record it."""
    files, moe, groups = native.files, native.moe, native.base0["param_groups"]
    return SavedLayout(
        zero_stage=files.zero_stage, dp=files.dp, lp_dtype=native.lp_dtype,
        flat_groups=[{"group": lay.group, "names": list(stored.members[k]),
                      "moe": fmt.group_name(groups[lay.group], files.optim[0])
                      if moe is not None and groups[lay.group].get("moe") else None}
                     for k, lay in enumerate(native.layouts)],
        param_shapes={n: list(stored.specs[optim_key(FP32, n)].shape) for names in stored.members for n in names},
        optimizer_scalars=scalars, optimizer_state_keys=keys, buffers=stored.buffers, frozen=stored.frozen,
        shared=shared_params(native.model0, native.where),
        experts={} if moe is None else moe.expert_meta(native.shapes))


def check_rank(native: NativeZero, keys: Sequence[str], r: int, rec: dict[str, Any]) -> RankData:
    """Rank ``r``'s flat fp32 partitions and state tensors, checked against the layout before any of
    their bytes are stored: a file cut another way would otherwise be written as wrong weights."""
    files, path = native.files, native.files.optim[r]
    fp32 = fmt.flat_fp32(rec, files.zero_stage, path)
    base = fmt.base_optimizer_state(rec, files.zero_stage, path)
    if len(fp32) != len(native.layouts):
        raise ManifestError(f"{path}: {len(fp32)} flat fp32 groups, expected {len(native.layouts)}")
    for k, lay in enumerate(native.layouts):
        used = max((f.local_start + f.numel for f in lay.fragments(native.group_rank(k, r))), default=0)
        want = lay.cut.partition_numel
        if not used <= fp32[k].numel() <= want:
            raise LayoutError(f"{path}: flat group {k} holds {fp32[k].numel()} fp32 elements; the ZeRO-"
                              f"{files.zero_stage} layout at DP {files.dp} gives {want} (at least {used} used)")
        for key in keys:
            t = base["state"][k][key]
            if t.numel() < used:
                raise LayoutError(f"{path}: optimizer state {key!r} of flat group {k} has {t.numel()} elements, "
                                  f"fewer than the {used} the layout needs")
    return {"fp32": fp32, "state": base["state"]}


class _RankSource:
    """The pieces of one native rank, read from its optimizer file when the writer starts that rank
    (rank 0's file is already read), so memory holds the files of the ranks being written only."""

    def __init__(self, native: NativeZero, keys: Sequence[str], getters: list[Getter], rank: int) -> None:
        path = native.files.optim[rank]
        self.getters = getters
        self.bytes_read = os.path.getsize(path)
        rec = native.optim0 if rank == 0 else fmt.optimizer_record(fmt.load_file(path), path)
        self.data = check_rank(native, keys, rank, rec)
        if native.files.zero_stage == 3 and native.frozen:
            model = native.model0 if rank == 0 else fmt.load_file(native.files.model[rank])
            self.bytes_read += 0 if rank == 0 else os.path.getsize(native.files.model[rank])
            self.data["frozen"] = frozen3_fragments(native, rank, model)

    def __len__(self) -> int:
        return len(self.getters)

    def __getitem__(self, ref: int) -> torch.Tensor:
        return self.getters[ref](self.data).contiguous()
