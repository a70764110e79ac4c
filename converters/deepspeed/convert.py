"""DeepSpeed ZeRO checkpoints into and out of ckptkit, and consolidated fp32 weights.

* :func:`import_deepspeed`: a native ``engine.save_checkpoint`` folder
  (``latest`` + ``global_stepN/``) -> a committed ckptkit checkpoint in the
  format of :mod:`ckptkit.adapters.deepspeed`, so
  ``ckptkit.adapters.deepspeed.load`` resumes it at any DP size and ZeRO
  stage. Each native DP rank becomes a virtual writer rank that stores the
  flat fragments of its own optimizer file (no re-partitioning, no gather);
  files are read one rank at a time (:mod:`ckptkit.engine.offline_writer`),
  through ``torch.load(weights_only=True)`` only (see
  :mod:`converters.deepspeed_format` for exactly what is trusted).
* :func:`export_deepspeed`: a ckptkit DeepSpeed checkpoint -> a native folder
  for a chosen DP size and ZeRO stage that ``engine.load_checkpoint`` accepts
  (the files DeepSpeed itself would have written at that size, rank by rank).
* :func:`consolidated_fp32_state_dict` / :func:`export_fp32`: the fp32 master
  weights as one state dict, equal to DeepSpeed's ``zero_to_fp32`` output
  (buffers in fp32, trainable parameters from the fp32 masters, tied aliases),
  read from a ckptkit checkpoint by model-space views.

DeepSpeed-MoE folders (per-expert ``layer_{L}_expert_{E}`` files; expert param
groups cut over the expert-data-parallel group) import, consolidate and export
with the experts stacked in model space (:mod:`converters.deepspeed_moe`);
MoE checkpoints saved without ZeRO (``expp_rank_*`` optimizer files) import
through :mod:`converters.deepspeed_expp`.

Native folders are local paths (DeepSpeed writes them with ``torch.save``).
"""

from __future__ import annotations

import json
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import ckptkit
from ckptkit.adapters.deepspeed import FORMAT, FP32, META, Space, model_key, optim_key
from ckptkit.engine.offline_writer import (
    ConvertResult,
    OfflineWriteOptions,
    write_offline,
)
from ckptkit.engine.state import dtype_name
from ckptkit.errors import LayoutError, ManifestError, StateMismatchError
from ckptkit.layout.box import Box, Region
from ckptkit.layout.values import encode_value, json_ready
from ckptkit.layout.zero_partition import (
    Fragment,
    Zero3SubGroup,
    Zero12Group,
    param_alignment,
    round_robin_order,
    zero3_sub_groups,
)
from ckptkit.storage.url import open_store
from ckptkit_converters.deepspeed import files as fmt
from ckptkit_converters.deepspeed import moe as dsm
from ckptkit_converters.common.source_paths import plain_name

META_KEY = f"deepspeed_engine/{META}"
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's zero_optimization.sub_group_size default


@dataclass(frozen=True)
class _Spec:
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class FlatLayout:
    """One flat partition (ZeRO-1/2 group or ZeRO-3 sub-group) at one DP size: its members and cut."""

    group: int
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    cut: Zero12Group | Zero3SubGroup

    def fragments(self, rank: int) -> list[Fragment]:
        return self.cut.fragments(rank)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def flat_layouts(groups: Sequence[Sequence[tuple[str, tuple[int, ...]]]], stage: int, dp: int, *,
                 round_robin: bool = False, align: int = 1,
                 sub_group_size: int = DEFAULT_SUB_GROUP_SIZE) -> list[FlatLayout]:
    """Every flat partition of a model whose param groups hold ``groups`` (name, shape), at ``dp``."""
    out = []
    for g, members in enumerate(groups):
        names = tuple(n for n, _ in members)
        shapes = tuple(tuple(s) for _, s in members)
        numels = tuple(_numel(s) for s in shapes)
        if stage < 3:
            order = tuple(round_robin_order(len(numels), dp)) if round_robin else None
            out.append(FlatLayout(g, names, shapes, Zero12Group(numels, dp, order, align)))
        else:
            for sub in zero3_sub_groups(numels, dp, sub_group_size):
                out.append(FlatLayout(g, tuple(names[i] for i in sub), tuple(shapes[i] for i in sub),
                                      Zero3SubGroup(tuple(numels[i] for i in sub), dp)))
    return out


def _count(record: Mapping[str, Any], key: str, where: str, default: int, minimum: int = 0) -> int:
    """An integer counter of a native record (``global_steps`` ...), refused by name when it is not one."""
    value = record.get(key, default)
    value = default if value is None else value
    if type(value) is not int or value < minimum:
        raise ManifestError(f"{where}: {key} is {value!r}; expected an integer >= {minimum}")
    return value


def _names(mapping: Any, where: str, what: str) -> dict[str, str]:
    """A name -> name map of a native record (``shared_params``), kept as it is or refused by name."""
    mapping = mapping or {}
    if not isinstance(mapping, Mapping) or not all(isinstance(a, str) and isinstance(b, str)
                                                   for a, b in mapping.items()):
        raise ManifestError(f"{where}: {what} is not a map of parameter names to parameter names")
    return dict(mapping)


# ---------------------------------------------------------------- import
def _record(model0: dict[str, Any], *, where: str, optim_where: str, stage: int, dp: int, lp_dtype: torch.dtype,
            param_groups: list[dict[str, Any]], scalars: list[dict[str, Any]], flat_groups: list[dict[str, Any]],
            param_shapes: dict[str, list[int]], buffers: list[str], keys: list[str], experts: dict[str, Any],
            frozen: Sequence[str] = ()) -> tuple[dict[str, Any], list[str]]:
    """The adapter's JSON record of an imported native checkpoint (what every import path shares), and the
    client-state keys skipped for not being JSON-representable.

    Param groups (read from ``optim_where``), the LR scheduler state and ``ds_config`` (from the model-states
    file ``where``) go through :func:`ckptkit.layout.values.json_ready`, the rule the live adapter applies to
    the same records: kept exactly, or refused naming the file and the key path — never turned into strings."""
    ds_config = model0.get("ds_config") or {}
    if not isinstance(ds_config, Mapping):
        raise ManifestError(f"{where}: ds_config is a {type(ds_config).__name__}, not the DeepSpeed config dict")
    gas = _count(ds_config, "gradient_accumulation_steps", f"{where}: ds_config", 1, minimum=1)
    steps = _count(model0, "global_steps", where, 0)
    meta = {
        "format": FORMAT, "stage": stage, "dp": dp, "lp_dtype": dtype_name(lp_dtype),
        "global_steps": steps, "global_samples": _count(model0, "global_samples", where, 0),
        "skipped_steps": _count(model0, "skipped_steps", where, 0),
        "micro_steps": steps * gas, "gradient_accumulation_steps": gas,
        "param_groups": [json_ready({k: v for k, v in pg.items() if k != "params"},
                                    f"{optim_where}: optimizer param group {g}") for g, pg in enumerate(param_groups)],
        "optimizer_scalars": scalars, "flat_groups": flat_groups, "param_shapes": param_shapes,
        "buffers": list(buffers), "frozen": list(frozen),
        "shared": _names(model0.get("shared_params"), where, "shared_params"),
        "experts": experts, "optimizer_state_keys": list(keys),
        "lr_scheduler": json_ready(model0.get("lr_scheduler"), f"{where}: lr_scheduler"),
        "client_state": {}, "ds_config": json_ready(ds_config, f"{where}: ds_config"),
    }
    skipped = []
    for k, v in model0.items():
        if k in fmt.DEEPSPEED_KEYS:
            continue
        try:
            if not isinstance(k, str):
                raise StateMismatchError(f"client state key {k!r} is not a string")
            meta["client_state"][k] = json_ready(v, f"{where}: client state {k!r}")
        except StateMismatchError:
            skipped.append(k if isinstance(k, str) else ascii(k))  # listed in the result, never stored
    return meta, skipped


def import_deepspeed(source: str | os.PathLike[str], dest: str | os.PathLike[str], *, tag: str | None = None,
                     options: OfflineWriteOptions = OfflineWriteOptions(threads=1),
                     storage_options: dict[str, Any] | None = None) -> ConvertResult:
    """Write the native DeepSpeed checkpoint ``source`` (tag ``tag``, default ``latest``) as a ckptkit
    checkpoint at ``dest``. Memory holds about ``options.threads`` ranks' optimizer files at a time."""
    t0 = time.perf_counter()
    from ckptkit_converters.deepspeed import expp as deepspeed_expp

    tag = fmt.read_tag(os.fspath(source), tag)  # one plain name, from the option or 'latest'
    if deepspeed_expp.expp_files(os.fspath(source), fmt.tag_dir(os.fspath(source), tag)):  # MoE without ZeRO
        return deepspeed_expp.import_expp(os.fspath(source), tag, dest, _record, options=options,
                                          storage_options=storage_options)
    files = fmt.find_files(os.fspath(source), tag)
    model0 = fmt.load_file(files.model[0])
    where = files.model[0]
    shapes = fmt.param_shapes(model0, where)
    ds_config = model0.get("ds_config") or {}
    zcfg = ds_config.get("zero_optimization") if isinstance(ds_config, dict) else None
    zcfg = zcfg or {}
    module = model0.get("module") or {}
    if not isinstance(zcfg, dict) or not isinstance(module, dict):
        raise ManifestError(f"{where}: 'module' must be a state dict and ds_config['zero_optimization'] a dict")
    if _count(model0, "dp_world_size", where, files.dp, minimum=1) != files.dp:
        raise ManifestError(f"{where}: dp_world_size {model0.get('dp_world_size')} but {files.dp} optimizer files")
    if files.stage == 3 and model0.get("frozen_param_shapes"):
        raise StateMismatchError(f"{where}: frozen parameters in a ZeRO-3 checkpoint are not supported by the import")
    first = next((n for g in shapes for n in g), None)
    if first is None or not isinstance(module.get(first), torch.Tensor):
        raise ManifestError(f"{where}: module state has no tensor for the first parameter {first!r} of param_shapes")
    rec0 = fmt.optimizer_record(fmt.load_file(files.optim[0]), files.optim[0])
    base0 = fmt.base_optimizer_state(rec0, files.stage, files.optim[0])
    tag_dir = os.path.join(files.folder, files.tag)
    moe = dsm.native_moe(files.folder, tag_dir, model0, shapes, rec0, base0["param_groups"], files.dp, files.stage,
                         where)
    lp_dtype = module[first].dtype
    cut = {"round_robin": bool(zcfg.get("round_robin_gradients")),
           "align": param_alignment(torch.tensor([], dtype=lp_dtype).element_size(), bool(zcfg.get("parameter_alignment"))),
           "sub_group_size": _count(zcfg, "sub_group_size", f"{where}: ds_config['zero_optimization']",
                                    DEFAULT_SUB_GROUP_SIZE, minimum=1)}
    if moe is None:
        layouts = flat_layouts([list(g.items()) for g in shapes], files.stage, files.dp, **cut)
    else:  # an expert group is cut over its expert-data-parallel group (ZeRO 1/2: one flat partition per group)
        layouts = [FlatLayout(g, lay.names, lay.shapes, lay.cut) for g, members in enumerate(shapes)
                   for lay in flat_layouts([list(members.items())], files.stage, moe.group_dp(g), **cut)]

    def group_rank(k: int, r: int) -> int:
        return r if moe is None else moe.group_rank(layouts[k].group, r)

    def space(k: int, r: int, i: int) -> Space:
        lay = layouts[k]
        if moe is None:
            return Space.whole(lay.names[i], lay.shapes[i])
        return moe.space(lay.group, r, lay.names[i], lay.shapes[i])
    if len(base0["state"]) != len(layouts):
        raise ManifestError(f"{files.optim[0]}: optimizer state for {len(base0['state'])} flat groups, the "
                            f"parameter groups give {len(layouts)}")
    state_keys, scalars = [], []
    for k in range(len(layouts)):
        st = base0["state"].get(k, {})
        if not isinstance(st, dict):
            raise ManifestError(f"{files.optim[0]}: optimizer state of flat group {k} is not a dict")
        state_keys.append(sorted(key for key, v in st.items() if isinstance(v, torch.Tensor) and v.dim() == 1))
        scalars.append({key: fmt.scalar(v, f"{files.optim[0]}: optimizer state {key!r} of flat group {k}")
                        for key, v in st.items() if not (isinstance(v, torch.Tensor) and v.dim() == 1)})
    keys = sorted(set(state_keys[0]))
    if any(sorted(set(s)) != keys for s in state_keys):
        raise ManifestError(f"{files.optim[0]}: flat groups hold different optimizer state keys {state_keys}")

    buffers = list(model0.get("buffer_names") or [])
    specs: dict[str, _Spec] = {}
    members: list[dict[str, None]] = [{} for _ in layouts]  # model-space names per flat group, in order
    for k, lay in enumerate(layouts):
        for r in range(1 if moe is None else max(moe.group_ep)):  # EP ranks 0..ep-1 hold every expert
            for i in range(len(lay.names)):
                sp = space(k, r, i)
                members[k][sp.name] = None
                specs[optim_key(FP32, sp.name)] = _Spec("float32", sp.shape)
                for key in keys:
                    specs[optim_key(key, sp.name)] = _Spec("float32", sp.shape)
                specs[model_key(sp.name)] = _Spec(dtype_name(lp_dtype), sp.shape)
    frozen = [n for n in (model0.get("frozen_param_shapes") or {})]
    for n in [*buffers, *frozen]:
        if n not in module:
            raise ManifestError(f"{where}: module state has no entry for {n!r}")
        specs[model_key(n)] = _Spec(dtype_name(module[n].dtype), tuple(module[n].shape))

    # piece lists: rank r stores its own fragments; rank 0 also the full module tensors (ZeRO 1/2) and buffers
    pieces: dict[int, list[tuple[str, Region]]] = {}
    getters: dict[int, list[Callable[[dict], torch.Tensor]]] = {}
    for r in range(files.dp):
        items, gets = pieces.setdefault(r, []), getters.setdefault(r, [])
        for k, lay in enumerate(layouts):
            for f in lay.fragments(group_rank(k, r)):
                sp = space(k, r, f.param)
                name, region = sp.name, Region(sp.box, (f.start, f.stop))
                a, b = f.local_start, f.local_start + f.numel
                items.append((optim_key(FP32, name), region))
                gets.append(lambda d, k=k, a=a, b=b: d["fp32"][k][a:b])
                for key in keys:
                    items.append((optim_key(key, name), region))
                    gets.append(lambda d, k=k, a=a, b=b, key=key: d["state"][k][key][a:b])
                if files.stage == 3:  # native ZeRO-3 stores no training-dtype partitions: derive them as DeepSpeed does
                    items.append((model_key(name), region))
                    gets.append(lambda d, k=k, a=a, b=b: d["fp32"][k][a:b].to(lp_dtype))
    dense = [] if files.stage == 3 else [n for lay in layouts for n in lay.names if moe is None or
                                         dsm.split_expert_name(n) is None]
    for n in dense + buffers + frozen:
        pieces[0].append((model_key(n), Region(Box.full(specs[model_key(n)].shape))))
        getters[0].append(lambda d, n=n: module[n].reshape(specs[model_key(n)].shape))
    if moe is not None:  # routed experts in the training dtype: from the per-expert files, each expert's box
        experts = dsm.ExpertFiles(files.folder, tag_dir, moe)
        for stacked, box, layer, e, local_key in experts.boxes(shapes):
            pieces[0].append((model_key(stacked), Region(box)))
            getters[0].append(lambda d, layer=layer, e=e, local_key=local_key, box=box:
                              experts.tensor(layer, e, local_key).reshape(box.sizes))

    def check_rank(r: int, rec: dict[str, Any]) -> dict[str, Any]:
        path = files.optim[r]
        fp32 = fmt.flat_fp32(rec, files.stage, path)
        base = fmt.base_optimizer_state(rec, files.stage, path)
        if len(fp32) != len(layouts):
            raise ManifestError(f"{path}: {len(fp32)} flat fp32 groups, expected {len(layouts)}")
        for k, lay in enumerate(layouts):
            used = max((f.local_start + f.numel for f in lay.fragments(group_rank(k, r))), default=0)
            want = lay.cut.partition_numel
            if not used <= fp32[k].numel() <= want:
                raise LayoutError(f"{path}: flat group {k} holds {fp32[k].numel()} fp32 elements; the ZeRO-"
                                  f"{files.stage} layout at DP {files.dp} gives {want} (at least {used} used)")
            for key in keys:
                t = base["state"][k][key]
                if t.numel() < used:
                    raise LayoutError(f"{path}: optimizer state {key!r} of flat group {k} has {t.numel()} elements, "
                                      f"fewer than the {used} the layout needs")
        return {"fp32": fp32, "state": base["state"]}

    class _Source:
        def __init__(self, rank: int) -> None:
            self.rank = rank
            self.bytes_read = os.path.getsize(files.optim[rank])
            rec = rec0 if rank == 0 else fmt.optimizer_record(fmt.load_file(files.optim[rank]), files.optim[rank])
            self.data = check_rank(rank, rec)

        def __len__(self) -> int:
            return len(getters[self.rank])

        def __getitem__(self, ref: int) -> torch.Tensor:
            return getters[self.rank][ref](self.data).contiguous()

    meta, skipped = _record(
        model0, where=where, optim_where=files.optim[0], stage=files.stage, dp=files.dp, lp_dtype=lp_dtype, param_groups=base0["param_groups"],
        scalars=scalars, keys=keys, buffers=buffers, frozen=frozen, experts={} if moe is None else moe.expert_meta(shapes),
        flat_groups=[{"group": lay.group, "names": list(members[k]),
                      "moe": fmt.group_name(pg, files.optim[0]) if moe is not None and pg.get("moe") else None}
                     for k, lay in enumerate(layouts) for pg in [base0["param_groups"][lay.group]]],
        param_shapes={n: list(specs[optim_key(FP32, n)].shape) for names in members for n in names})
    out = open_store(dest, storage_options)
    result = write_offline(
        out, world_size=files.dp, tensors=specs, pieces=pieces, source=lambda r, _: _Source(r),
        values={META_KEY: encode_value(json.dumps(meta), META_KEY)},
        meta={"user": {}, "converted_from": {"url": os.path.join(files.folder, files.tag), "format": "deepspeed",
                                             "stage": files.stage, "dp": files.dp,
                                             "skipped_client_state": skipped}},
        parallel=f"dp{files.dp}", options=options, what=f"importing {files.folder}/{files.tag} into {out.url}",
        layouts=None if moe is None else dsm.layouts_with_rules(
            specs, pieces, {k for k in specs if k.split("/", 2)[-1] in meta["experts"]}))
    return ConvertResult(os.path.join(files.folder, files.tag), out.url, "ckptkit", len(specs), result.nbytes,
                         result.bytes_read, time.perf_counter() - t0)


# ---------------------------------------------------------------- export
def read_meta(view: Any) -> dict[str, Any]:
    values = view.values
    if META_KEY not in values:
        raise ManifestError(f"{view.url}: not a checkpoint of ckptkit's DeepSpeed adapter (no {META_KEY!r})")
    return json.loads(values[META_KEY])


def _groups_of(meta: dict[str, Any]) -> list[list[tuple[str, tuple[int, ...]]]]:
    groups: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
    for fg in meta["flat_groups"]:
        groups.setdefault(int(fg["group"]), []).extend((n, tuple(meta["param_shapes"][n])) for n in fg["names"])
    return [groups[g] for g in sorted(groups)]


class _ParamCache:
    """Whole parameters read from a view, keeping the last few (fragments of neighbouring ranks share them)."""

    def __init__(self, view: Any, keep: int = 4) -> None:
        self.view, self.keep, self.cache = view, keep, OrderedDict()

    def flat(self, key: str) -> torch.Tensor:
        if key not in self.cache:
            self.cache[key] = self.view[key].read().reshape(-1)
            while len(self.cache) > self.keep:
                self.cache.popitem(last=False)
        return self.cache[key]


def _add_aliases(module: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Tied parameters appear under every name in ``module.state_dict()``, which DeepSpeed loads strictly."""
    for alias, name in meta.get("shared", {}).items():
        module[alias] = module[name]


def export_deepspeed(source: str | os.PathLike[str], dest: str | os.PathLike[str], *, dp: int,
                     stage: int | None = None, tag: str | None = None, ds_config: dict[str, Any] | None = None,
                     ep: int | None = None, storage_options: dict[str, Any] | None = None) -> ConvertResult:
    """Write the ckptkit DeepSpeed checkpoint ``source`` as a native folder ``dest`` (``latest`` +
    ``tag``, default ``global_step<N>``) for ``dp`` ranks at ZeRO ``stage`` (default: the saving stage),
    with the default flattening (no round robin, no parameter alignment, one ZeRO-3 sub-group per group).
    DeepSpeed-MoE checkpoints are written for expert-parallel size ``ep`` (default: the saving one):
    per-expert ``layer_{L}_expert_{E}`` files and ZeRO-1/2 expert groups cut over ``dp / ep`` ranks."""
    t0 = time.perf_counter()
    import deepspeed
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.utils.tensor_fragment import fragment_address

    view = ckptkit.open(source, storage_options=storage_options)
    meta = read_meta(view)
    stage = int(stage or meta["stage"])
    if stage not in (1, 2, 3) or dp < 1:
        raise LayoutError(f"export to ZeRO stage {stage} at DP {dp}: stage must be 1, 2 or 3 and dp >= 1")
    groups = _groups_of(meta)
    experts = meta.get("experts") or {}
    members: list[list[dsm.LocalMember] | None] = [None] * len(groups)
    if experts:
        eps = {int(info["ep"]) for info in experts.values()}
        ep = int(ep or (eps.pop() if len(eps) == 1 else 0))
        if stage == 3 or ep < 1 or dp % ep:
            raise LayoutError(f"{view.url}: MoE export to ZeRO stage {stage} at DP {dp}, EP {ep or sorted(eps)}: "
                              "needs ZeRO 1 or 2, one EP size for every MoE layer, and EP dividing DP")
        members = [dsm.local_members(g, experts, ep) for g in groups]
        layouts = [FlatLayout(g, lay.names, lay.shapes, lay.cut) for g, group in enumerate(groups)
                   for lay in flat_layouts([group if members[g] is None else
                                            [(m.local, m.shape) for m in members[g]]],
                                           stage, dp if members[g] is None else dp // ep)]
    else:
        ep = 1
        layouts = flat_layouts(groups, stage, dp)

    def grank(k: int, r: int) -> int:
        return r if members[layouts[k].group] is None else r // ep

    def src(k: int, r: int, i: int) -> tuple[str, int]:
        """The model-space tensor fragment i of layout k on rank r reads, and its element offset in it."""
        ms = members[layouts[k].group]
        if ms is None:
            return layouts[k].names[i], 0
        m = ms[i]
        local = int(experts[m.stacked]["num_experts"]) // ep
        return m.stacked, ((r % ep) * local + m.j) * m.numel

    def fill(k: int, r: int, key: Callable[[str], str]) -> torch.Tensor:
        lay = layouts[k]
        out = torch.zeros(lay.cut.partition_numel, dtype=torch.float32)
        for f in lay.fragments(grank(k, r)):
            name, at = src(k, r, f.param)
            out[f.local_start:f.local_start + f.numel] = cache.flat(key(name))[at + f.start:at + f.stop]
        return out

    if stage == 3 and len(layouts) != len(groups):
        raise LayoutError("export to ZeRO-3 with several sub-groups per param group is not supported")
    lp_dtype = getattr(torch, meta["lp_dtype"])
    keys = list(meta["optimizer_state_keys"])
    scal = {n: meta["optimizer_scalars"][i] for i, fg in enumerate(meta["flat_groups"]) for n in fg["names"]}
    for k, lay in enumerate(layouts):
        for i, n in enumerate(lay.names):
            scal.setdefault(n, scal.get(src(k, 0, i)[0], {}))
    ds_config = ds_config if ds_config is not None else meta.get("ds_config", {})
    tag = plain_name(tag, f"{dest}: the tag option") if tag is not None else f"global_step{meta['global_steps']}"
    folder = os.path.join(os.fspath(dest), tag)
    os.makedirs(folder, exist_ok=False)
    version = deepspeed.__version__
    nbytes = 0
    prefix = "bf16_" if lp_dtype == torch.bfloat16 else ""

    def base_state(rank_flat: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        state = {}
        for k, lay in enumerate(layouts):
            st: dict[str, Any] = {}
            for key, rec in scal[lay.names[0]].items():
                st[key] = rec["value"] if rec["dtype"] is None else torch.tensor(rec["value"], dtype=getattr(torch, rec["dtype"]))
            st.update({key: rank_flat[k][key] for key in keys})
            state[k] = st
        pgs = []
        for g, pg in enumerate(meta["param_groups"]):
            pg = {k: (tuple(v) if k == "betas" else v) for k, v in pg.items()}
            if members[g] is not None:  # DeepSpeed-MoE names an expert group after its EP size
                pg.update(name=f"ep_size_{ep}", moe=True)
            pgs.append({**pg, "params": [k for k, lay in enumerate(layouts) if lay.group == g]})
        return {"state": state, "param_groups": pgs}

    common = {
        "buffer_names": list(meta["buffers"]), "optimizer": None,
        "param_shapes": [OrderedDict((n, torch.Size(s)) for n, s in g) if members[i] is None else
                         OrderedDict((m.local, torch.Size(m.shape)) for m in members[i]) for i, g in enumerate(groups)],
        "frozen_param_shapes": None, "shared_params": dict(meta.get("shared", {})), "frozen_param_fragments": None,
        "lr_scheduler": meta["lr_scheduler"], "data_sampler": None, "random_ltd": None,
        "skipped_steps": meta["skipped_steps"],
        "global_steps": meta["global_steps"], "global_samples": meta["global_samples"],
        "dp_world_size": dp, "mp_world_size": 1, "ds_config": ds_config, "ds_version": version,
        **meta["client_state"],
    }
    if experts:  # what _save_moe_checkpoint adds: expert counts per MoE layer, in layer order
        by_layer = {int(i["layer"]): int(i["num_experts"]) for i in experts.values()}
        common.update(num_experts=[by_layer[L] for L in range(len(by_layer))], ds_autoep_layers=None)
    if meta.get("frozen"):
        raise StateMismatchError(f"{view.url}: frozen parameters are not supported by the native export")
    cache = _ParamCache(view)
    for r in range(dp):
        flats = [{key: fill(k, r, lambda n, key=key: optim_key(key, n)) for key in [FP32, *keys]}
                 for k in range(len(layouts))]
        rec: dict[str, Any] = {"loss_scaler": LossScaler(1.0), "dynamic_loss_scale": False, "overflow": False,
                               "zero_stage": stage, "ds_version": version}
        if stage < 3:
            rec["base_optimizer_state"] = base_state(flats)
            rec["single_partition_of_fp32_groups"] = [
                flats[k][FP32][:lay.cut.partition_numel - lay.cut.padding(grank(k, r))] for k, lay in enumerate(layouts)]
            rec["group_paddings"] = [lay.cut.padding(grank(k, r)) for k, lay in enumerate(layouts)]
            rec["partition_count"] = [dp if members[lay.group] is None else dp // ep for lay in layouts]
            rec["param_slice_mappings"] = [
                OrderedDict((lay.names[f.param], fragment_address(numel=f.numel, start=f.local_start))
                            for f in lay.fragments(grank(k, r))) for k, lay in enumerate(layouts)]
        else:
            rec["optimizer_state_dict"] = base_state(flats)
            rec["fp32_flat_groups"] = [flats[k][FP32] for k in range(len(layouts))]
            rec["partition_count"] = dp
            module = OrderedDict((n, torch.empty(0, dtype=lp_dtype)) for g in groups for n, _ in g)
            for b in meta["buffers"]:
                module[b] = view[model_key(b)].read()
            _add_aliases(module, meta)
            torch.save({"module": module, **common},
                       os.path.join(folder, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"))
        torch.save({"optimizer_state_dict": rec, "ds_version": version},
                   os.path.join(folder, f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
        nbytes += sum(t.numel() * 4 for fl in flats for t in fl.values())
    if stage < 3:
        module = OrderedDict((n, view[model_key(n)].read()) for g in groups for n, _ in g if n not in experts)
        layers: dict[int, list[str]] = {}
        for n, info in experts.items():
            layers.setdefault(int(info["layer"]), []).append(n)
        for layer, stacked_names in sorted(layers.items()):  # one file per global expert, keys by global id
            stacked = {n: view[model_key(n)].read() for n in stacked_names}
            for e in range(int(experts[stacked_names[0]]["num_experts"])):
                torch.save(OrderedDict((f"{experts[n]['module']}.{e}.{experts[n]['param']}", t[e].clone())
                                       for n, t in stacked.items()), dsm.expert_file(folder, layer, e))
        for b in meta["buffers"]:
            module[b] = view[model_key(b)].read()
        _add_aliases(module, meta)
        torch.save({"module": module, **common}, os.path.join(folder, fmt.MODEL_STATES_12))
    with open(os.path.join(os.fspath(dest), fmt.LATEST), "w", encoding="utf-8") as f:
        f.write(tag)
    return ConvertResult(view.url, folder, "deepspeed", len(meta["param_shapes"]), nbytes, view.bytes_read,
                         time.perf_counter() - t0)


# ---------------------------------------------------------------- fp32
def consolidated_fp32_state_dict(source: str | os.PathLike[str], *,
                                 storage_options: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The full fp32 model from a ckptkit DeepSpeed checkpoint, as DeepSpeed's ``zero_to_fp32`` gives it:
    floating buffers cast to fp32, every trainable parameter from its fp32 master, tied aliases shared.
    DeepSpeed-MoE experts come out once per global expert under the names a model built at ep=1 has
    (``<moe>.deepspeed_moe.experts.deepspeed_experts.{e}.<param>``, DeepSpeed's per-expert-file names), so
    the dict loads into it with ``load_state_dict``; every element of every expert must be stored."""
    view = ckptkit.open(source, storage_options=storage_options)
    meta = read_meta(view)
    out: dict[str, torch.Tensor] = {}
    for b in meta["buffers"]:
        t = view[model_key(b)].read()
        out[b] = t.float() if t.is_floating_point() else t
    for n in meta.get("frozen", []):
        out[n] = view[model_key(n)].read().float()
    experts = meta.get("experts") or {}
    for n in meta["param_shapes"]:
        t = view[optim_key(FP32, n)].read()  # a missing expert piece: CoverageError naming the expert
        if n in experts:  # a stacked routed-expert tensor: one entry per global expert, as an ep=1 model names it
            info = experts[n]
            for e in range(int(info["num_experts"])):
                out[f"{info['module']}.{e}.{info['param']}"] = t[e].clone()
        else:
            out[n] = t
    for alias, name in meta.get("shared", {}).items():
        if name in out:
            out[alias] = out[name]
    return out


def export_fp32(source: str | os.PathLike[str], out_file: str | os.PathLike[str], *,
                storage_options: dict[str, Any] | None = None) -> ConvertResult:
    """Write :func:`consolidated_fp32_state_dict` as a safetensors file (tied aliases as copies)."""
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    sd = consolidated_fp32_state_dict(source, storage_options=storage_options)
    seen: set[int] = set()
    flat = {}
    for k, v in sd.items():
        flat[k] = v.clone() if id(v) in seen else v.contiguous()
        seen.add(id(v))
    save_file(flat, os.fspath(out_file))
    return ConvertResult(str(source), os.fspath(out_file), "safetensors", len(flat),
                         sum(v.numel() * v.element_size() for v in flat.values()), 0, time.perf_counter() - t0)
