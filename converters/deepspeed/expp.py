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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ckptkit.adapters.deepspeed import FP32, Space, model_key, optim_key
from ckptkit.engine.offline_writer import (
    ConvertResult,
    OfflineWriteOptions,
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
from ckptkit.storage.url import open_store
from ckptkit_converters.deepspeed import files as fmt
from ckptkit_converters.deepspeed import moe as dsm
from ckptkit_converters.common.source_paths import regular_file

EXPP = fmt.EXPP_OPTIM


@dataclass(frozen=True)
class _Spec:
    dtype: str
    shape: tuple[int, ...]


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


def _dp_world(model0: dict[str, Any], where: str, default: int) -> int:
    value = model0.get("dp_world_size", default)
    if type(value) is not int or value < 1:
        raise ManifestError(f"{where}: dp_world_size is {value!r}; expected a positive integer")
    return value


def _optimizer(path: str) -> dict[str, Any]:
    data = fmt.load_file(path).get("optimizer")
    if not isinstance(data, dict) or not isinstance(data.get("state"), dict) or \
            not isinstance(data.get("param_groups"), list):
        raise ManifestError(f"{path}: no 'optimizer' state dict (state, param_groups)")
    return data


def import_expp(folder: str, tag: str, dest: str | os.PathLike[str], meta_of: Callable[..., tuple[dict[str, Any], list[str]]], *,
                options: OfflineWriteOptions, storage_options: dict[str, Any] | None) -> ConvertResult:
    """Import the stage-0 MoE checkpoint ``folder/tag`` into ckptkit at ``dest``. ``meta_of`` builds the
    adapter's JSON record from the fields both import paths share (:func:`converters.deepspeed._record`)."""
    t0 = time.perf_counter()
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
    buffers = list(model0.get("buffer_names") or [])
    groups = _optimizer(files[0])["param_groups"]
    moe_groups = [g for g, pg in enumerate(groups) if pg.get("moe")]
    name = fmt.group_name(groups[moe_groups[0]], files[0]) if len(moe_groups) == 1 else ""
    ep = int(name[len("ep_size_"):]) if re.fullmatch(r"ep_size_[1-9]\d*", name) else 0
    # DeepSpeed numbers the files by EP rank in the *largest* expert group the process has ever created
    # (groups._get_max_expert_size_name); with consecutive EP groups, files 0..ep-1 are EP ranks 0..ep-1
    if not ep or len(files) % ep:
        raise StateMismatchError(f"{files[0]}: expert param groups {[groups[g].get('name') for g in moe_groups]} "
                                 f"with {len(files)} expp_rank files; the import handles one expert group "
                                 "(named ep_size_<EP>) whose EP size divides the number of files")
    files = {r: files[r] for r in range(ep)}
    opts = {r: _optimizer(p) for r, p in files.items()}
    gm = moe_groups[0]
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
    moe = dsm.NativeMoE(layers, tuple(ep if g == gm else 1 for g in range(len(groups))), ep)
    experts = dsm.ExpertFiles(folder, tag_dir, moe)  # every expert file present, else CoverageError naming it

    dense = [n for n in module if n not in buffers]
    params_of: dict[int, list[_Param]] = {r: [] for r in range(ep)}
    at = 0
    for g, pg in enumerate(groups):
        if g == gm:
            continue
        for idx in pg["params"]:
            if at >= len(dense):
                raise ManifestError(f"{files[0]}: param group {g} has more parameters than the module's {len(dense)}")
            n = dense[at]
            at += 1
            for r in range(ep):
                params_of[r].append(_Param(idx, Space.whole(n, tuple(module[n].shape)), n, False))
    if at != len(dense):
        raise ManifestError(f"{files[0]}: dense param groups hold {at} parameters, the module {len(dense)}")
    for r in range(ep):
        local: list[tuple[Space, str]] = []
        for layer in sorted(layers.values(), key=lambda x: x.layer):
            for j in range(layer.local):
                e = r * layer.local + j
                for key, t in fmt.load_file(experts.paths[(layer.layer, e)]).items():
                    parts = dsm.split_expert_name(key)
                    if parts is None or parts[:2] != (layer.prefix, e):
                        raise ManifestError(f"{experts.paths[(layer.layer, e)]}: key {key!r} is not of expert {e}")
                    shape = tuple(t.shape)
                    local.append((Space(f"{layer.prefix}.{parts[2]}", (layer.num_experts, *shape),
                                        Box((e,) + (0,) * len(shape), (1, *shape))), key))
        idxs = opts[r]["param_groups"][gm]["params"]
        if len(idxs) != len(local):
            raise ManifestError(f"{files[r]}: expert group holds {len(idxs)} parameters, EP rank {r}'s expert files "
                                f"{len(local)}")
        params_of[r] += [_Param(idx, sp, key, True) for idx, (sp, key) in zip(idxs, local)]

    keys: list[str] | None = None
    scalars: list[dict[str, Any]] = [{} for _ in groups]
    group_of = {idx: g for g, pg in enumerate(groups) for idx in pg["params"]}
    for r in range(ep):
        for idx, sp, _, expert in params_of[r]:
            st = opts[r]["state"].get(idx, {})
            tensors = sorted(k for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim() > 0)
            keys = tensors if keys is None else keys
            pshape = sp.box.sizes[1:] if expert else sp.shape
            if tensors != keys or any(tuple(st[k].shape) != pshape for k in tensors):
                raise ManifestError(f"{files[r]}: optimizer state {idx} ({sp.name}) has {tensors} shaped "
                                    f"{[tuple(st[k].shape) for k in tensors]}; expected {keys} shaped like the "
                                    f"parameter {list(pshape)}")
            sc = {k: fmt.scalar(v, f"{files[r]}: optimizer state {k!r} of {sp.name}") for k, v in st.items()
                  if k not in tensors}
            g = group_of[idx]
            if scalars[g] and scalars[g] != sc:
                raise StateMismatchError(f"{files[r]}: optimizer scalars of {sp.name} ({sc}) differ from the rest "
                                         f"of param group {g} ({scalars[g]}); cannot keep one per group")
            scalars[g] = sc
    keys = keys or []
    for n in dense:
        if module[n].dtype != torch.float32:
            raise StateMismatchError(f"{model_path}: {n!r} is {module[n].dtype}; without ZeRO there are no fp32 "
                                     "masters, so only fp32 training imports")

    specs: dict[str, Any] = {}
    pieces: dict[int, list[tuple[str, Region]]] = {r: [] for r in range(ep)}
    getters: dict[int, list[Callable[[], torch.Tensor]]] = {r: [] for r in range(ep)}
    for r in range(ep):
        for idx, sp, src, expert in params_of[r]:
            if not expert and r > 0:
                continue  # dense: every expp file holds the same state; rank 0 writes it
            layer, e = -1, -1
            if expert:
                parts = dsm.split_expert_name(src)
                assert parts is not None
                layer, e = moe.layers[parts[0]].layer, parts[1]
            weight = ((lambda layer=layer, e=e, src=src, box=sp.box: experts.tensor(layer, e, src).reshape(box.sizes))
                      if expert else (lambda n=src: module[n]))
            for key, get in [(model_key(sp.name), weight), (optim_key(FP32, sp.name), weight)] + [
                    (optim_key(k, sp.name), lambda r=r, idx=idx, k=k, box=sp.box:
                     opts[r]["state"][idx][k].reshape(box.sizes)) for k in keys]:
                specs[key] = _Spec("float32", sp.shape)
                pieces[r].append((key, Region(sp.box)))
                getters[r].append(get)
    for b in buffers:
        specs[model_key(b)] = _Spec(dtype_name(module[b].dtype), tuple(module[b].shape))
        pieces[0].append((model_key(b), Region(Box.full(tuple(module[b].shape)))))
        getters[0].append(lambda b=b: module[b])

    names: list[list[str]] = [[] for _ in groups]
    shapes: dict[str, list[int]] = {}
    for r in range(ep):
        for idx, sp, _, _ in params_of[r]:
            if sp.name not in names[group_of[idx]]:
                names[group_of[idx]].append(sp.name)
            shapes[sp.name] = list(sp.shape)
    expert_meta = moe.expert_meta([{p.src: () for r in range(ep) for p in params_of[r] if p.expert}])
    meta, skipped = meta_of(
        model0, where=model_path, optim_where=files[0], stage=0, dp=int(_dp_world(model0, model_path, ep)),
        lp_dtype=torch.float32, param_groups=groups,
        scalars=scalars, param_shapes=shapes, buffers=buffers, keys=keys, experts=expert_meta,
        flat_groups=[{"group": g, "names": names[g], "moe": name if g == gm else None} for g in range(len(groups))])

    class _Source:
        def __init__(self, rank: int) -> None:
            self.rank = rank
            self.bytes_read = os.path.getsize(files[rank])

        def __len__(self) -> int:
            return len(getters[self.rank])

        def __getitem__(self, ref: int) -> torch.Tensor:
            return getters[self.rank][ref]().contiguous()

    out = open_store(dest, storage_options)
    meta_key = "deepspeed_engine/deepspeed"
    result = write_offline(
        out, world_size=ep, tensors=specs, pieces=pieces, source=lambda r, _: _Source(r),
        values={meta_key: encode_value(json.dumps(meta), meta_key)},
        meta={"user": {}, "converted_from": {"url": tag_dir, "format": "deepspeed", "stage": 0, "ep": ep,
                                             "skipped_client_state": skipped}},
        parallel=f"ep{ep}", options=options, what=f"importing {tag_dir} into {out.url}",
        layouts=dsm.layouts_with_rules(specs, pieces, {k for k in specs if k.split("/", 2)[-1] in expert_meta}))
    return ConvertResult(tag_dir, out.url, "ckptkit", len(specs), result.nbytes, result.bytes_read,
                         time.perf_counter() - t0)
