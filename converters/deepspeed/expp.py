"""DeepSpeed-MoE checkpoints written without ZeRO (stage 0): ``expp_rank_*`` optimizer files -> ckptkit.

Without ZeRO, ``engine.save_checkpoint`` of a model with ``deepspeed.moe.layer.MoE``
layers writes (``deepspeed/runtime/engine.py``: ``_save_moe_checkpoint``,
``_get_optimizer_ckpt_name``):

* ``mp_rank_00_model_states.pt``: the module without its routed experts,
  ``num_experts`` per MoE layer, counters, scheduler, config, client state;
* ``layer_{L}_expert_{E}_mp_rank_00_model_states.pt``: each global expert;
* ``expp_rank_{r}_mp_rank_00_optim_states.pt``: ``{"optimizer": state_dict}``
  of the torch optimizer on EP rank ``r`` (written by its first expert-DP rank):
  per-parameter state indexed like ``model.parameters()`` split into the dense
  group(s) and the expert group (``split_params_into_different_moe_groups_for_optimizer``),
  the expert group holding EP rank ``r``'s local experts.

The files record no parameter names for the optimizer indices, so they are
re-derived exactly as DeepSpeed built the groups: dense parameters in module
order (the module's state-dict keys without its buffers), experts layer by
layer, local expert by local expert, each expert's parameters in its file's
order; every optimizer tensor's shape is checked against the parameter's. The
result is a checkpoint of :mod:`ckptkit.adapters.deepspeed` (the fp32 weights
are the masters: stage 0 trains them directly), which a ZeRO-1/2 engine at any
DP / EP size loads. Only fp32 training, one expert group and no tied
parameters are supported (refused otherwise, naming the file).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ckptkit.adapters.deepspeed import FP32, Space, model_key, optim_key
from ckptkit.adapters.deepspeed_record import RecordSources, SavedLayout
from ckptkit.engine.offline_writer import (
    ConvertResult,
    OfflineWriteOptions,
    StoredTensor,
    write_offline,
)
from ckptkit.engine.state import dtype_name
from ckptkit.errors import (
    CheckpointNotFoundError,
    CoverageError,
    ManifestError,
    StateMismatchError,
)
from ckptkit.layout.box import Box, Region
from ckptkit.layout.values import encode_value
from ckptkit.options import Progress
from ckptkit.storage.url import open_store
from ckptkit_converters.deepspeed import files as fmt
from ckptkit_converters.deepspeed import moe as dsm
from ckptkit_converters.deepspeed.record import META_KEY, native_count, native_record, shared_params
from ckptkit_converters.common.source_paths import regular_file

EXPP = fmt.EXPP_OPTIM
Getter = Callable[[], torch.Tensor]


class _Param(NamedTuple):
    """One optimizer-indexed parameter of an EP rank: its index in the torch optimizer state, where it sits in
    model space, its key in the module state or its expert file, and whether it is a routed expert's."""

    idx: int
    space: Space
    src: str
    expert: bool


def expp_files(folder: str, tag_dir: str) -> dict[int, str]:
    """The ``expp_rank_*`` optimizer files of a tag directory of ``folder``, by EP rank (empty: not such a
    checkpoint); each checked to be a regular file inside ``folder``."""
    out = {}
    if not os.path.isdir(tag_dir):
        return out
    for name in sorted(os.listdir(tag_dir)):
        m = EXPP.match(name)
        if m is None:
            continue
        if int(m[2]) != 0:
            raise ManifestError(f"{tag_dir}/{name}: model-parallel rank {m[2]}; only mp_rank_00 is supported")
        out[int(m[1])] = regular_file(folder, os.path.join(tag_dir, name))
    return out


def _optimizer(path: str) -> dict[str, Any]:
    data = fmt.load_file(path).get("optimizer")
    if not isinstance(data, dict) or not isinstance(data.get("state"), dict) or \
            not isinstance(data.get("param_groups"), list):
        raise ManifestError(f"{path}: no 'optimizer' state dict (state, param_groups)")
    return data


@dataclass(frozen=True)
class ExppCheckpoint:
    """What a stage-0 MoE folder holds, checked: its optimizer files by EP rank (those of EP ranks
    ``0..ep-1``) and their contents, the model-states file, the param groups (``expert_group`` the
    index of the one expert group, named ``group_name``) and the MoE layers with their expert files."""

    folder: str
    tag_dir: str
    files: dict[int, str]
    model_path: str
    model0: dict[str, Any]
    module: dict[str, Any]
    buffers: list[str]
    groups: list[dict[str, Any]]
    expert_group: int
    group_name: str
    ep: int
    opts: dict[int, dict[str, Any]]
    moe: dsm.NativeMoE
    experts: dsm.ExpertFiles

    @property
    def layers(self) -> Mapping[str, dsm.MoELayer]:
        return self.moe.layers


def import_expp(folder: str, tag: str, dest: str | os.PathLike[str], *,
                options: OfflineWriteOptions, storage_options: dict[str, Any] | None,
                progress: Progress | None = None) -> ConvertResult:
    """Import the stage-0 MoE checkpoint ``folder/tag`` into ckptkit at ``dest``; the adapter's record
    is built as for a ZeRO import (:func:`ckptkit_converters.deepspeed.record.native_record`).
    ``progress(done, total)``: bytes of tensors written, as the offline writer reports them."""
    t0 = time.perf_counter()
    ck = read_expp(folder, tag)
    dense = dense_params(ck)  # the same on every EP rank
    params_of = {r: dense + expert_params(ck, r) for r in range(ck.ep)}
    keys, scalars = state_kinds(ck, params_of)
    for n in [n for n in ck.module if n not in ck.buffers]:
        if ck.module[n].dtype != torch.float32:
            raise StateMismatchError(f"{ck.model_path}: {n!r} is {ck.module[n].dtype}; without ZeRO there are no "
                                     "fp32 masters, so only fp32 training imports")
    specs, pieces, getters = stored_pieces(ck, params_of, keys)
    meta, skipped = _record(ck, params_of, keys, scalars)
    out = open_store(dest, storage_options)
    result = write_offline(
        out, world_size=ck.ep, tensors=specs, pieces=pieces, source=lambda r, _: _EpRankSource(ck.files[r], getters[r]),
        values={META_KEY: encode_value(json.dumps(meta), META_KEY)},
        meta={"user": {}, "converted_from": {"url": ck.tag_dir, "format": "deepspeed", "stage": 0, "ep": ck.ep,
                                             "skipped_client_state": skipped}},
        parallel=f"ep{ck.ep}", options=options, progress=progress, what=f"importing {ck.tag_dir} into {out.url}",
        layouts=dsm.layouts_with_rules(specs, pieces, {k for k in specs if k.split("/", 2)[-1] in meta["experts"]}))
    return ConvertResult(ck.tag_dir, out.url, "ckptkit", len(specs), result.nbytes, result.bytes_read,
                         time.perf_counter() - t0)


def read_expp(folder: str, tag: str) -> ExppCheckpoint:
    """The files of the stage-0 MoE checkpoint ``folder/tag``, checked before any tensor is taken: the
    ``expp_rank_*`` files, the model states (no tied parameters), the one expert group and its EP size,
    and every MoE layer's expert files."""
    tag_dir = fmt.tag_dir(folder, tag)
    files = expp_files(folder, tag_dir)
    if not files or sorted(files) != list(range(len(files))):
        raise ManifestError(f"{tag_dir}: expp_rank optimizer files for EP ranks {sorted(files)}, expected "
                            f"0..{len(files) - 1}")
    model_path = os.path.join(tag_dir, fmt.MODEL_STATES_12)
    if not os.path.lexists(model_path):
        raise CheckpointNotFoundError(f"{tag_dir}: {fmt.MODEL_STATES_12} is missing")
    model0 = fmt.load_file(regular_file(folder, model_path))
    module = model0.get("module")
    if not isinstance(module, dict):
        raise ManifestError(f"{model_path}: no 'module' state dict")
    if model0.get("shared_params"):
        raise StateMismatchError(f"{model_path}: tied parameters; the stage-0 MoE import does not support them")
    groups = _optimizer(files[0])["param_groups"]
    expert_group, name, ep = _expert_group(groups, files)
    files = {r: files[r] for r in range(ep)}
    opts = {r: _optimizer(p) for r, p in files.items()}
    moe = dsm.NativeMoE(_moe_layers(folder, tag_dir, model0, model_path, ep),
                        tuple(ep if g == expert_group else 1 for g in range(len(groups))), ep)
    experts = dsm.ExpertFiles(folder, tag_dir, moe)  # every expert file present, else CoverageError naming it
    return ExppCheckpoint(folder, tag_dir, files, model_path, model0, module, list(model0.get("buffer_names") or []),
                          groups, expert_group, name, ep, opts, moe, experts)


def _expert_group(groups: list[dict[str, Any]], files: dict[int, str]) -> tuple[int, str, int]:
    """The index, name and EP size of the one expert param group (DeepSpeed names it ``ep_size_<EP>``)."""
    moe_groups = [g for g, pg in enumerate(groups) if pg.get("moe")]
    name = fmt.group_name(groups[moe_groups[0]], files[0]) if len(moe_groups) == 1 else ""
    ep = int(name[len("ep_size_"):]) if re.fullmatch(r"ep_size_[1-9][0-9]*", name) else 0
    # DeepSpeed numbers the files by EP rank in the *largest* expert group the process has ever created
    # (groups._get_max_expert_size_name); with consecutive EP groups, files 0..ep-1 are EP ranks 0..ep-1
    if not ep or len(files) % ep:
        raise StateMismatchError(f"{files[0]}: expert param groups {[groups[g].get('name') for g in moe_groups]} "
                                 f"with {len(files)} expp_rank files; the import handles one expert group "
                                 "(named ep_size_<EP>) whose EP size divides the number of files")
    return moe_groups[0], name, ep


def _moe_layers(folder: str, tag_dir: str, model0: Mapping[str, Any], model_path: str,
                ep: int) -> dict[str, dsm.MoELayer]:
    """Every MoE layer by module prefix; which module layer ``L`` is, its expert-0 file's keys say."""
    num_experts = model0.get("num_experts")
    if not isinstance(num_experts, list) or not num_experts:
        raise ManifestError(f"{model_path}: no per-layer 'num_experts' list")
    layers = {}
    for layer, total in enumerate(num_experts):
        path = dsm.expert_file(tag_dir, layer, 0)
        if not os.path.lexists(path):
            raise CoverageError(f"{path}: missing: nothing stored for expert 0 (of {total}) of MoE layer {layer}")
        prefixes = {p[0] for p in map(dsm.split_expert_name, fmt.load_file(regular_file(folder, path)))
                    if p is not None}
        if len(prefixes) != 1 or total % ep:
            raise ManifestError(f"{path}: expected one MoE layer's expert 0 with experts divisible by EP {ep}")
        prefix = prefixes.pop()
        layers[prefix] = dsm.MoELayer(layer, prefix, total, ep, f"ep_size_{ep}")
    return layers


def dense_params(ck: ExppCheckpoint) -> list[_Param]:
    """The dense parameters of every EP rank by optimizer index: DeepSpeed built the dense groups from
    ``model.parameters()`` in module order, which the module's state-dict keys without its buffers are."""
    dense = [n for n in ck.module if n not in ck.buffers]
    out: list[_Param] = []
    at = 0
    for g, pg in enumerate(ck.groups):
        if g == ck.expert_group:
            continue
        for idx in pg["params"]:
            if at >= len(dense):
                raise ManifestError(f"{ck.files[0]}: param group {g} has more parameters than the module's "
                                    f"{len(dense)}")
            n = dense[at]
            at += 1
            out.append(_Param(idx, Space.whole(n, tuple(ck.module[n].shape)), n, False))
    if at != len(dense):
        raise ManifestError(f"{ck.files[0]}: dense param groups hold {at} parameters, the module {len(dense)}")
    return out


def expert_params(ck: ExppCheckpoint, r: int) -> list[_Param]:
    """EP rank ``r``'s routed-expert parameters by optimizer index, in DeepSpeed's order: layer by layer,
    local expert by local expert, each expert's parameters in its file's order."""
    local: list[tuple[Space, str]] = []
    for layer in sorted(ck.layers.values(), key=lambda x: x.layer):
        for j in range(layer.local):
            e = r * layer.local + j
            path = ck.experts.paths[(layer.layer, e)]
            for key, t in fmt.load_file(path).items():
                parts = dsm.split_expert_name(key)
                if parts is None or parts[:2] != (layer.prefix, e):
                    raise ManifestError(f"{path}: key {key!r} is not of expert {e}")
                shape = tuple(t.shape)
                local.append((Space(f"{layer.prefix}.{parts[2]}", (layer.num_experts, *shape),
                                    Box((e,) + (0,) * len(shape), (1, *shape))), key))
    idxs = ck.opts[r]["param_groups"][ck.expert_group]["params"]
    if len(idxs) != len(local):
        raise ManifestError(f"{ck.files[r]}: expert group holds {len(idxs)} parameters, EP rank {r}'s expert files "
                            f"{len(local)}")
    return [_Param(idx, sp, key, True) for idx, (sp, key) in zip(idxs, local)]


def state_kinds(ck: ExppCheckpoint, params_of: Mapping[int, list[_Param]]
                ) -> tuple[list[str], list[dict[str, Any]]]:
    """The state tensor kinds every parameter holds, each checked to have the parameter's shape, and one
    scalar record per param group (the adapter keeps one per group: they must agree within it)."""
    keys: list[str] | None = None
    scalars: list[dict[str, Any]] = [{} for _ in ck.groups]
    group_of = {idx: g for g, pg in enumerate(ck.groups) for idx in pg["params"]}
    for r in range(ck.ep):
        for idx, sp, _, expert in params_of[r]:
            st = ck.opts[r]["state"].get(idx, {})
            tensors = sorted(k for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim() > 0)
            keys = tensors if keys is None else keys
            pshape = sp.box.sizes[1:] if expert else sp.shape
            if tensors != keys or any(tuple(st[k].shape) != pshape for k in tensors):
                raise ManifestError(f"{ck.files[r]}: optimizer state {idx} ({sp.name}) has {tensors} shaped "
                                    f"{[tuple(st[k].shape) for k in tensors]}; expected {keys} shaped like the "
                                    f"parameter {list(pshape)}")
            sc = {k: fmt.scalar(v, f"{ck.files[r]}: optimizer state {k!r} of {sp.name}") for k, v in st.items()
                  if k not in tensors}
            fmt.check_step(sc, f"{ck.files[r]}: {sp.name}")
            g = group_of[idx]
            if scalars[g] and scalars[g] != sc:
                raise StateMismatchError(f"{ck.files[r]}: optimizer scalars of {sp.name} ({sc}) differ from the rest "
                                         f"of param group {g} ({scalars[g]}); cannot keep one per group")
            scalars[g] = sc
    return keys or [], scalars


def stored_pieces(ck: ExppCheckpoint, params_of: Mapping[int, list[_Param]], keys: Sequence[str]
                  ) -> tuple[dict[str, StoredTensor], dict[int, list[tuple[str, Region]]], dict[int, list[Getter]]]:
    """Every stored tensor, and which EP rank stores which piece: each rank its experts' boxes, rank 0
    the dense parameters (every expp file holds the same dense state) and the buffers. The fp32
    weights are both the model and the masters: stage 0 trains them directly."""
    specs: dict[str, StoredTensor] = {}
    pieces: dict[int, list[tuple[str, Region]]] = {r: [] for r in range(ck.ep)}
    getters: dict[int, list[Getter]] = {r: [] for r in range(ck.ep)}
    for r in range(ck.ep):
        for p in params_of[r]:
            if not p.expert and r > 0:
                continue  # dense: every expp file holds the same state; rank 0 writes it
            weight = _weight_getter(ck, p)
            for key, get in [(model_key(p.space.name), weight), (optim_key(FP32, p.space.name), weight)] + [
                    (optim_key(k, p.space.name), lambda r=r, idx=p.idx, k=k, box=p.space.box:
                     ck.opts[r]["state"][idx][k].reshape(box.sizes)) for k in keys]:
                specs[key] = StoredTensor("float32", p.space.shape)
                pieces[r].append((key, Region(p.space.box)))
                getters[r].append(get)
    for b in ck.buffers:
        specs[model_key(b)] = StoredTensor(dtype_name(ck.module[b].dtype), tuple(ck.module[b].shape))
        pieces[0].append((model_key(b), Region(Box.full(tuple(ck.module[b].shape)))))
        getters[0].append(lambda b=b: ck.module[b])
    return specs, pieces, getters


def _weight_getter(ck: ExppCheckpoint, p: _Param) -> Getter:
    """The fp32 weight of ``p``: a routed expert's from its expert file (shaped as its box of the
    stacked tensor), a dense parameter's from the module state."""
    if not p.expert:
        return lambda n=p.src: ck.module[n]
    parts = dsm.split_expert_name(p.src)
    assert parts is not None
    layer, e = ck.layers[parts[0]].layer, parts[1]
    return lambda layer=layer, e=e, src=p.src, box=p.space.box: ck.experts.tensor(layer, e, src).reshape(box.sizes)


def _record(ck: ExppCheckpoint, params_of: Mapping[int, list[_Param]], keys: list[str],
            scalars: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """The adapter's record: the param groups' members by model-space name, the expert group's named as
    DeepSpeed names it, at stage 0 over the folder's DP size (``dp_world_size``, default the EP size)."""
    names: list[list[str]] = [[] for _ in ck.groups]
    shapes: dict[str, list[int]] = {}
    group_of = {idx: g for g, pg in enumerate(ck.groups) for idx in pg["params"]}
    for r in range(ck.ep):
        for idx, sp, _, _ in params_of[r]:
            if sp.name not in names[group_of[idx]]:
                names[group_of[idx]].append(sp.name)
            shapes[sp.name] = list(sp.shape)
    layout = SavedLayout(
        zero_stage=0, dp=native_count(ck.model0, "dp_world_size", ck.model_path, ck.ep, minimum=1),
        lp_dtype=torch.float32,
        flat_groups=[{"group": g, "names": names[g], "moe": ck.group_name if g == ck.expert_group else None}
                     for g in range(len(ck.groups))],
        param_shapes=shapes, optimizer_scalars=scalars, optimizer_state_keys=keys, buffers=ck.buffers, frozen=[],
        shared=shared_params(ck.model0, ck.model_path),
        experts=ck.moe.expert_meta([{p.src: () for r in range(ck.ep) for p in params_of[r] if p.expert}]))
    return native_record(ck.model0, layout, ck.groups, RecordSources(ck.model_path, ck.files[0]))


class _EpRankSource:
    """The pieces one EP rank stores, each read when the writer asks for it."""

    def __init__(self, path: str, getters: list[Getter]) -> None:
        self.getters = getters
        self.bytes_read = os.path.getsize(path)

    def __len__(self) -> int:
        return len(self.getters)

    def __getitem__(self, ref: int) -> torch.Tensor:
        return self.getters[ref]().contiguous()
