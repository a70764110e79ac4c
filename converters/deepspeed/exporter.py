"""A ckptkit DeepSpeed checkpoint -> a native folder ``engine.load_checkpoint`` accepts, at any DP size.

The folder holds the files DeepSpeed itself would have written at the chosen DP size, ZeRO stage and
(DeepSpeed-MoE) expert-parallel size, rank by rank: ``latest``, the model states (one file at ZeRO
1/2, one per rank at ZeRO 3, plus one per global expert for MoE) and each rank's optimizer file with
its flat partitions cut as :mod:`ckptkit_converters.deepspeed.flat_layout` computes them, filled from
the model-space tensors. The flattening is DeepSpeed's default (no round robin, no parameter
alignment, one ZeRO-3 sub-group per param group), which a loading engine with the default config
expects. DeepSpeed is imported to pickle its ``LossScaler`` and ``fragment_address`` objects, which
its loader expects; the record carries no loss scaler (fp16 is refused on the way in), so every file
gets DeepSpeed's static scale of 1.0, as bf16 and fp32 engines write it.
"""

from __future__ import annotations

import os
import shutil
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import ckptkit
from ckptkit.adapters.deepspeed import FP32, model_key, optim_key
from ckptkit.adapters.deepspeed_record import scalar_value
from ckptkit.engine.offline_writer import ConvertResult
from ckptkit.errors import LayoutError
from ckptkit.layout.zero_partition import Zero3SubGroup, zero3_partition_numel
from ckptkit.offline.spread import Dealt, agreed, same_source, spread_comm, write_then_commit
from ckptkit.options import Progress
from ckptkit_converters.common.source_paths import local_destination, plain_name
from ckptkit_converters.deepspeed import files as fmt
from ckptkit_converters.deepspeed import moe as dsm
from ckptkit_converters.deepspeed.flat_layout import FlatLayout, flat_layouts
from ckptkit_converters.deepspeed.record import read_meta
from ckptkit_converters.common.renamed import zero_stage_renamed

Group = list[tuple[str, tuple[int, ...]]]
"""One param group's members: (model-space name, shape)."""


@dataclass(frozen=True)
class DeepSpeedClasses:
    """The DeepSpeed objects a native optimizer file pickles, which its loader expects: ``LossScaler``,
    ``fragment_address``, and the version the files are stamped with."""

    loss_scaler: Callable[[float], Any]
    fragment_address: Callable[..., Any]
    version: str

    @staticmethod
    def load() -> DeepSpeedClasses:
        import deepspeed
        from deepspeed.runtime.fp16.loss_scaler import LossScaler
        from deepspeed.utils.tensor_fragment import fragment_address

        return DeepSpeedClasses(LossScaler, fragment_address, deepspeed.__version__)


@dataclass(frozen=True)
class ExportPlan:
    """What the target folder holds: the source record, the target ZeRO stage, DP and EP sizes, the param
    groups in model space and, per group, its local expert members at the target EP (None: dense), the
    target's flat partitions, and the training dtype."""

    meta: dict[str, Any]
    zero_stage: int
    dp: int
    ep: int
    groups: list[Group]
    members: list[list[dsm.LocalMember] | None]
    layouts: list[FlatLayout]
    lp_dtype: torch.dtype

    @property
    def experts(self) -> dict[str, Any]:
        return self.meta.get("experts") or {}

    def group_rank(self, k: int, r: int) -> int:
        """The partition of flat group ``k`` target rank ``r`` holds: an expert group is cut over
        ``dp / ep`` ranks (EP groups are consecutive ranks)."""
        return r if self.members[self.layouts[k].group] is None else r // self.ep

    def partition_count(self, lay: FlatLayout) -> int:
        return self.dp if self.members[lay.group] is None else self.dp // self.ep

    def source(self, k: int, r: int, i: int) -> tuple[str, int]:
        """The model-space tensor member ``i`` of flat group ``k`` on rank ``r`` reads, and its element
        offset in it (a local expert's slice of the stacked tensor, by global expert id)."""
        ms = self.members[self.layouts[k].group]
        if ms is None:
            return self.layouts[k].names[i], 0
        m = ms[i]
        local = int(self.experts[m.stacked]["num_experts"]) // self.ep
        return m.stacked, ((r % self.ep) * local + m.j) * m.numel


@zero_stage_renamed
def export_deepspeed(source: str | os.PathLike[str], dest: str | os.PathLike[str], *, dp: int,
                     zero_stage: int | None = None, tag: str | None = None, ds_config: dict[str, Any] | None = None,
                     ep: int | None = None, storage_options: dict[str, Any] | None = None,
                     progress: Progress | None = None, process_group: Any = None) -> ConvertResult:
    """Write the ckptkit DeepSpeed checkpoint ``source`` as a native folder ``dest`` (``latest`` +
    ``tag``, default ``global_step<N>``) for ``dp`` ranks at ZeRO ``zero_stage`` (default: the saving
    stage), with the default flattening (no round robin, no parameter alignment, one ZeRO-3 sub-group
    per group). DeepSpeed-MoE checkpoints are written for expert-parallel size ``ep`` (default: the
    saving one): per-expert ``layer_{L}_expert_{E}`` files and ZeRO-1/2 expert groups cut over
    ``dp / ep`` ranks. (``stage=``: the old keyword, one more release, with a DeprecationWarning.)
    ``progress(done, total)``: bytes of the tensors the native files hold, reported as each file is
    written, against a total the plan gives before the first one is. ``latest`` is written last (the
    export's commit); a failed export removes its tag folder.

    ``process_group`` (a ``torchrun`` job's; call on every process with the same arguments): the dp
    ranks' files (and the model states) are dealt to its processes, each writes its own, process 0
    writes ``latest`` once all are there; a failure anywhere fails every process. The same files as
    one process writes."""
    t0 = time.perf_counter()
    comm = spread_comm(process_group)
    job = agreed(comm, lambda: _prepare(source, dest, dp, zero_stage, tag, ds_config, ep, storage_options))
    same_source(comm, job.view.url, job.view.manifest.attempt)
    units = dp + (1 if job.plan.zero_stage < 3 else 0)  # the dp ranks' files, then the model states
    per_rank = sum(lay.cut.partition_numel for lay in job.plan.layouts) * 4 * (1 + len(job.plan.meta["optimizer_state_keys"]))
    sizes = {u: per_rank if u < dp else max(0, job.total - dp * per_rank) for u in range(units)}
    dealt = Dealt(comm, sizes, units, progress, job.total, "deepspeed-export")
    write_then_commit(comm, dealt, lambda mine: _write_units(job, mine, dealt.tick), lambda _: _write_latest(job),
                      lambda: shutil.rmtree(job.folder, ignore_errors=True))
    # every rank's file holds its fp32 partitions, one per group and kind: the bytes the result reports
    return ConvertResult(job.view.url, job.folder, "deepspeed", len(job.plan.meta["param_shapes"]), dp * per_rank,
                         job.view.bytes_read, time.perf_counter() - t0)


@dataclass
class _Job:
    """What every process of an export finds the same before anything is written."""

    view: Any
    plan: ExportPlan
    common: dict[str, Any]
    ds: DeepSpeedClasses
    dest: str
    tag: str
    folder: str
    total: int


def _prepare(source: str | os.PathLike[str], dest: str | os.PathLike[str], dp: int, zero_stage: int | None,
             tag: str | None, ds_config: dict[str, Any] | None, ep: int | None,
             storage_options: dict[str, Any] | None) -> _Job:
    dest = local_destination(dest, "the DeepSpeed export")  # before anything is read
    ds = DeepSpeedClasses.load()
    view = ckptkit.open(source, storage_options=storage_options)
    plan = plan_export(view.url, read_meta(view), dp, zero_stage, ep)
    common = model_states_record(plan, ds_config if ds_config is not None else plan.meta.get("ds_config", {}),
                                 ds.version)
    tag = plain_name(tag, f"{dest}: the tag option") if tag is not None else f"global_step{plan.meta['global_steps']}"
    folder = os.path.join(os.fspath(dest), tag)
    if os.path.exists(folder):
        raise FileExistsError(f"{folder} exists: the export writes a new tag folder (choose another tag or remove it)")
    return _Job(view, plan, common, ds, os.fspath(dest), tag, folder, planned_bytes(plan, view))


def _write_units(job: _Job, mine: list[int], tick: Callable[[int], None]) -> None:
    """Write the units numbered ``mine`` (dp ranks' files; ``dp``: the ZeRO-1/2 model states)."""
    plan, cache = job.plan, _ParamCache(job.view)
    os.makedirs(job.folder, exist_ok=True)
    for r in mine:
        if r == plan.dp:
            _write_model_states_12(plan, job.view, job.folder, job.common, tick)
            continue
        flats = [{key: _fill(plan, cache, k, r, lambda n, key=key: optim_key(key, n))
                  for key in [FP32, *plan.meta["optimizer_state_keys"]]} for k in range(len(plan.layouts))]
        _write_rank(plan, job.view, job.folder, r, flats, job.common, job.ds, tick)


def _write_latest(job: _Job) -> None:
    """Point ``latest`` at the new tag by an atomic rename: rewriting it in place could leave an existing
    DeepSpeed folder with an empty or partial ``latest`` if the write failed half-way."""
    path = os.path.join(job.dest, fmt.LATEST)
    staged = f"{path}.{os.getpid()}.tmp"
    try:
        with open(staged, "w", encoding="utf-8") as f:
            f.write(job.tag)
            f.flush()
            os.fsync(f.fileno())
        os.replace(staged, path)
    finally:
        if os.path.exists(staged):
            os.remove(staged)


def _groups_of(meta: dict[str, Any]) -> list[Group]:
    """The saving engine's param groups in model space, from the record's flat groups."""
    groups: dict[int, Group] = {}
    for fg in meta["flat_groups"]:
        groups.setdefault(int(fg["group"]), []).extend((n, tuple(meta["param_shapes"][n])) for n in fg["names"])
    return [groups[g] for g in sorted(groups)]


def plan_export(url: str, meta: dict[str, Any], dp: int, zero_stage: int | None, ep: int | None) -> ExportPlan:
    """The target's ZeRO stage, EP size and flat partitions, refused where DeepSpeed could not load the
    result (stage outside 1-3, MoE at ZeRO 3 or with an EP size that does not divide DP, several ZeRO-3
    sub-groups per param group, which the default config would not cut)."""
    zero_stage = int(zero_stage or meta["stage"])
    if zero_stage not in (1, 2, 3) or dp < 1:
        raise LayoutError(f"export to ZeRO stage {zero_stage} at DP {dp}: stage must be 1, 2 or 3 and dp >= 1")
    groups = _groups_of(meta)
    experts = meta.get("experts") or {}
    members: list[list[dsm.LocalMember] | None] = [None] * len(groups)
    if experts:
        eps = {int(info["ep"]) for info in experts.values()}
        ep = int(ep or (eps.pop() if len(eps) == 1 else 0))
        if zero_stage == 3 or ep < 1 or dp % ep:
            raise LayoutError(f"{url}: MoE export to ZeRO stage {zero_stage} at DP {dp}, EP {ep or sorted(eps)}: "
                              "needs ZeRO 1 or 2, one EP size for every MoE layer, and EP dividing DP")
        members = [dsm.local_members(g, experts, ep) for g in groups]
        layouts = [FlatLayout(g, lay.names, lay.shapes, lay.cut) for g, group in enumerate(groups)
                   for lay in flat_layouts([group if members[g] is None else
                                            [(m.local, m.shape) for m in members[g]]],
                                           zero_stage, dp if members[g] is None else dp // ep)]
    else:
        ep = 1
        layouts = flat_layouts(groups, zero_stage, dp)
    if zero_stage == 3 and len(layouts) != len(groups):
        raise LayoutError("export to ZeRO-3 with several sub-groups per param group is not supported")
    return ExportPlan(meta, zero_stage, dp, ep, groups, members, layouts, getattr(torch, meta["lp_dtype"]))


def _fill(plan: ExportPlan, cache: _ParamCache, k: int, r: int, key: Callable[[str], str]) -> torch.Tensor:
    """Rank ``r``'s flat partition of flat group ``k`` (fp32 masters, or one state kind by ``key``),
    padding zero, filled fragment by fragment from the model-space tensors."""
    lay = plan.layouts[k]
    out = torch.zeros(lay.cut.partition_numel, dtype=torch.float32)
    for f in lay.fragments(plan.group_rank(k, r)):
        name, at = plan.source(k, r, f.param)
        out[f.local_start:f.local_start + f.numel] = cache.flat(key(name))[at + f.start:at + f.stop]
    return out


def _scalars_by_member(plan: ExportPlan) -> dict[str, dict[str, Any]]:
    """Each member's per-group optimizer scalars, by its name in the target's flat groups (a local
    expert's name maps to its stacked tensor's group)."""
    meta = plan.meta
    scal = {n: meta["optimizer_scalars"][i] for i, fg in enumerate(meta["flat_groups"]) for n in fg["names"]}
    for k, lay in enumerate(plan.layouts):
        for i, n in enumerate(lay.names):
            scal.setdefault(n, scal.get(plan.source(k, 0, i)[0], {}))
    return scal


def _base_state(plan: ExportPlan, rank_flat: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """The base (torch) optimizer's state dict of one rank: per flat group its scalars and state
    tensors, and the param groups, an expert group named after the target EP size as DeepSpeed-MoE
    names it (its loader looks the process groups up by that name)."""
    scal = _scalars_by_member(plan)
    state = {}
    for k, lay in enumerate(plan.layouts):
        st: dict[str, Any] = {key: scalar_value(rec) for key, rec in scal[lay.names[0]].items()}
        st.update({key: rank_flat[k][key] for key in plan.meta["optimizer_state_keys"]})
        state[k] = st
    pgs = []
    for g, pg in enumerate(plan.meta["param_groups"]):
        pg = {k: (tuple(v) if k == "betas" else v) for k, v in pg.items()}
        if plan.members[g] is not None:
            pg.update(name=f"ep_size_{plan.ep}", moe=True)
        pgs.append({**pg, "params": [k for k, lay in enumerate(plan.layouts) if lay.group == g]})
    return {"state": state, "param_groups": pgs}


def model_states_record(plan: ExportPlan, ds_config: dict[str, Any], version: str) -> dict[str, Any]:
    """What every model-states file holds besides the module: DeepSpeed's own keys, from the record, at
    the target DP size, and the client state merged in as ``save_checkpoint`` merges it."""
    meta, groups = plan.meta, plan.groups
    common = {
        "buffer_names": list(meta["buffers"]), "optimizer": None,
        "param_shapes": [OrderedDict((n, torch.Size(s)) for n, s in g) if plan.members[i] is None else
                         OrderedDict((m.local, torch.Size(m.shape)) for m in plan.members[i])
                         for i, g in enumerate(groups)],
        "frozen_param_shapes": None, "shared_params": dict(meta.get("shared", {})), "frozen_param_fragments": None,
        "lr_scheduler": meta["lr_scheduler"], "data_sampler": None, "random_ltd": None,
        "skipped_steps": meta["skipped_steps"],
        "global_steps": meta["global_steps"], "global_samples": meta["global_samples"],
        "dp_world_size": plan.dp, "mp_world_size": 1, "ds_config": ds_config, "ds_version": version,
        **meta["client_state"],
    }
    if plan.experts:  # what _save_moe_checkpoint adds: expert counts per MoE layer, in layer order
        by_layer = {int(i["layer"]): int(i["num_experts"]) for i in plan.experts.values()}
        common.update(num_experts=[by_layer[L] for L in range(len(by_layer))], ds_autoep_layers=None)
    return common


def planned_bytes(plan: ExportPlan, view: Any) -> int:
    """The bytes of the tensors every native file of ``plan`` will hold (what :func:`tensor_bytes` counts
    of each as it is saved), so that progress has its total before the first file is written: per rank
    its flat partitions (at ZeRO 1/2 the fp32 one without its padding) and per-group scalars, then the
    module (ZeRO 1/2: once, routed experts in their own files; ZeRO 3: its buffers, on every rank)."""
    scal = _scalars_by_member(plan)
    kinds = len(plan.meta["optimizer_state_keys"])
    total = 0
    for r in range(plan.dp):
        for k, lay in enumerate(plan.layouts):
            numel = lay.cut.partition_numel
            fp32 = numel - lay.cut.padding(plan.group_rank(k, r)) if plan.zero_stage < 3 else numel
            total += 4 * (fp32 + kinds * numel) + tensor_bytes([scalar_value(rec)
                                                                for rec in scal[lay.names[0]].values()])
    buffers = sum(view[model_key(b)].nbytes for b in plan.meta["buffers"])
    if plan.zero_stage == 3:  # each rank: the buffers, and its padded partition of every frozen parameter
        frozen3 = sum(zero3_partition_numel(tv.numel, plan.dp) * (tv.nbytes // max(tv.numel, 1)) * plan.dp
                      for tv in (view[model_key(n)] for n in plan.meta.get("frozen", [])))
        return total + plan.dp * buffers + frozen3
    frozen = sum(view[model_key(n)].nbytes for n in plan.meta.get("frozen", []))
    return total + buffers + frozen + sum(view[model_key(n)].nbytes for g in plan.groups for n, _ in g)


def tensor_bytes(obj: Any, seen: set[int] | None = None) -> int:
    """Bytes of the distinct tensors inside ``obj`` (dicts, lists, tuples), each counted once: a tied
    alias is the same tensor under two names, and ``torch.save`` stores it once too."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    return 0


def _save(obj: Any, path: str, tick: Callable[[int], None]) -> None:
    """``torch.save`` one native file, then report the bytes of the tensors it holds."""
    torch.save(obj, path)
    tick(tensor_bytes(obj))


def _write_rank(plan: ExportPlan, view: Any, folder: str, r: int, flats: list[dict[str, torch.Tensor]],
                common: dict[str, Any], ds: DeepSpeedClasses, tick: Callable[[int], None]) -> None:
    """Rank ``r``'s optimizer file (and at ZeRO 3 its model-states file, the module with empty
    parameters: their weights are in the fp32 partitions), as DeepSpeed's optimizer ``state_dict``."""
    rec: dict[str, Any] = {"loss_scaler": ds.loss_scaler(1.0), "dynamic_loss_scale": False, "overflow": False,
                           "zero_stage": plan.zero_stage, "ds_version": ds.version}
    layouts = plan.layouts
    if plan.zero_stage < 3:
        rec["base_optimizer_state"] = _base_state(plan, flats)
        rec["single_partition_of_fp32_groups"] = [
            flats[k][FP32][:lay.cut.partition_numel - lay.cut.padding(plan.group_rank(k, r))]
            for k, lay in enumerate(layouts)]
        rec["group_paddings"] = [lay.cut.padding(plan.group_rank(k, r)) for k, lay in enumerate(layouts)]
        rec["partition_count"] = [plan.partition_count(lay) for lay in layouts]
        rec["param_slice_mappings"] = [
            OrderedDict((lay.names[f.param], ds.fragment_address(numel=f.numel, start=f.local_start))
                        for f in lay.fragments(plan.group_rank(k, r))) for k, lay in enumerate(layouts)]
    else:
        rec["optimizer_state_dict"] = _base_state(plan, flats)
        rec["fp32_flat_groups"] = [flats[k][FP32] for k in range(len(layouts))]
        rec["partition_count"] = plan.dp
        module = OrderedDict((n, torch.empty(0, dtype=plan.lp_dtype)) for g in plan.groups for n, _ in g)
        for b in plan.meta["buffers"]:
            module[b] = view[model_key(b)].read()
        frozen = _frozen_partitions3(plan, view, r)
        module.update((n, torch.empty(0, dtype=t.dtype)) for n, t in frozen.items())
        listed = {"frozen_param_shapes": OrderedDict((n, torch.Size(view[model_key(n)].shape)) for n in frozen),
                  "frozen_param_fragments": frozen} if frozen else {}
        _add_aliases(module, plan.meta)
        _save({"module": module, **common, **listed}, os.path.join(folder, fmt.model3_file_name(r)), tick)
    prefix = "bf16_" if plan.lp_dtype == torch.bfloat16 else ""
    _save({"optimizer_state_dict": rec, "ds_version": ds.version},
          os.path.join(folder, fmt.optim_file_name(r, prefix)), tick)


def _frozen_partitions3(plan: ExportPlan, view: Any, r: int) -> OrderedDict[str, torch.Tensor]:
    """Rank ``r``'s ZeRO-3 partition of every frozen parameter, as DeepSpeed keeps it in ``ds_tensor``
    and saves it in ``frozen_param_fragments``: elements ``[r*p, (r+1)*p)`` of the flattened parameter,
    ``p = ceil(numel / dp)``, zero-padded at the end of the last partitions. Only the rows of the
    leading axis that the range touches are read: a frozen base model is most of a fine-tuning run's
    weights, and reading each parameter whole for every rank would read it ``dp`` times."""
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for n in plan.meta.get("frozen", []):
        tv = view[model_key(n)]
        sub = Zero3SubGroup((tv.numel,), plan.dp)
        part = torch.zeros(sub.partition_numel, dtype=tv.dtype)
        f = sub.param_fragment(0, r)
        if f is not None:
            if len(tv.shape) == 0:
                part[:1] = tv.read().reshape(-1)
            else:
                row = tv.numel // tv.shape[0]  # elements per index of the leading axis
                a, b = f.start // row, -(-f.stop // row)
                part[:f.numel] = tv[a:b].reshape(-1)[f.start - a * row:f.stop - a * row]
        out[n] = part
    return out


def _write_model_states_12(plan: ExportPlan, view: Any, folder: str, common: dict[str, Any],
                           tick: Callable[[int], None]) -> None:
    """The ZeRO-1/2 model states: the whole module in its training dtype without routed experts, frozen
    parameters included (listed in ``frozen_param_shapes`` / ``frozen_param_fragments`` at ZeRO 2, as
    DeepSpeed lists them), and one file per global expert (keys by global id), as
    ``_save_moe_checkpoint`` writes them."""
    experts = plan.experts
    module = OrderedDict((n, view[model_key(n)].read()) for g in plan.groups for n, _ in g if n not in experts)
    layers: dict[int, list[str]] = {}
    for n, info in experts.items():
        layers.setdefault(int(info["layer"]), []).append(n)
    for layer, stacked_names in sorted(layers.items()):
        stacked = {n: view[model_key(n)].read() for n in stacked_names}
        for e in range(int(experts[stacked_names[0]]["num_experts"])):
            _save(OrderedDict((f"{experts[n]['module']}.{e}.{experts[n]['param']}", t[e].clone())
                              for n, t in stacked.items()), dsm.expert_file(folder, layer, e), tick)
    for b in plan.meta["buffers"]:
        module[b] = view[model_key(b)].read()
    frozen = OrderedDict((n, view[model_key(n)].read()) for n in plan.meta.get("frozen", []))
    module.update(frozen)  # as DeepSpeed's module state dict holds them: whole, in their own dtype
    if frozen and plan.zero_stage == 2:  # DeepSpeed lists them from stage 2 on (zero_to_fp32 reads these)
        common = {**common, "frozen_param_shapes": OrderedDict((n, t.shape) for n, t in frozen.items()),
                  "frozen_param_fragments": frozen}
    _add_aliases(module, plan.meta)
    _save({"module": module, **common}, os.path.join(folder, fmt.MODEL_STATES_12), tick)


class _ParamCache:
    """Whole parameters read from a view, keeping the last few (fragments of neighbouring ranks share them)."""

    def __init__(self, view: Any, keep: int = 4) -> None:
        self.view, self.keep = view, keep
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()

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
