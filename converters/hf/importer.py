"""Hugging Face safetensors back to checkpoint names: routed experts stacked again, QKV fused again.

The inverse of :func:`ckptkit_converters.hf.exporter.export_hf`, with the same key tables.
Each HF tensor name is matched to the rule (and layer, expert) it comes from; the tensors of one
rule are grouped into the checkpoint tensor they form (``w1_EFD`` ``[E, F, D]`` from E
``...experts.{e}.gate_proj.weight``; Megatron's ``[layers, E, 2F, D]`` fc1 from gate and up of
every layer and expert), and that grouping must be complete: a missing expert, layer or part is a
:class:`~ckptkit.errors.MissingKeysError` naming the layer, the expert and the HF key, never a
tensor with a hole.

The folder is untrusted input: files are read through a byte store with ranged reads
(:mod:`ckptkit_converters.hf.files`: each header checked as the ``safetensors`` package checks it,
and by the package itself where the file is local; a hub cache snapshot read through its repo
folder), then checked against the config (:mod:`ckptkit_converters.hf.expect`: every tensor
present once, of the implied shape and dtype, nothing else) before anything is written. No pickle,
and ``s3://`` works like a local path. :func:`import_hf` writes a ckptkit checkpoint piece by piece
(one piece per layer / expert slice: memory is one slice); :func:`read_hf` returns a dict, for
models that fit in memory (tests, small models).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ckptkit_converters.common.renamed import divisible_by_renamed
from ckptkit_converters.hf.families import (
    TORCHTITAN,
    Family,
    Rule,
    family_for,
    family_named,
)
from ckptkit_converters.hf.expect import HF_ONLY, check_folder
from ckptkit_converters.hf.files import (
    INDEX_NAME,
    SafetensorsFile,
    check_index,
    open_files,
    open_folder,
    open_source,
)
from ckptkit_converters.hf.mapping import AttentionHeads, HFConfig, invert, match_hf
from ckptkit_converters.hf.options import MODEL_PREFIX, HFImportOptions

from ckptkit.engine.offline_writer import (
    ConvertResult,
    OfflineCheckpoint,
    OfflineWriteOptions,
    StoredTensor,
    write_offline,
)
from ckptkit.errors import CkptkitError, MissingKeysError, OptionsError
from ckptkit.layout.box import Box, Region
from ckptkit.layout.manifest import ExplicitLayout, TensorMeta
from ckptkit.layout.rules import PartitionRule
from ckptkit.options import Progress
from ckptkit.storage.url import open_store

__all__ = ["HF_ONLY", "INDEX_NAME", "HFImportOptions", "SafetensorsFile", "import_hf", "open_files", "plan_import",
           "read_hf"]


# ---------------------------------------------------------------- grouping


@dataclass(frozen=True)
class Piece:
    """One slice of a checkpoint tensor (``index`` along its leading axes) and the HF tensors forming it."""

    index: tuple[int, ...]
    sources: tuple[tuple[str, str], ...]  # (file, HF name) per rule output
    layer: int | None
    expert: int | None


@dataclass(frozen=True)
class Target:
    """A checkpoint tensor to rebuild: ``key`` (no prefix), its rule, shape, dtype and pieces."""

    key: str
    rule: Rule
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]


def plan_import(files: Mapping[str, SafetensorsFile], family: Family, cfg: HFConfig, where: str,
                weight_map: Mapping[str, str] | None = None) -> list[Target]:
    """Every checkpoint tensor the HF tensors form, once the folder is checked to be the model its config
    describes (:func:`~ckptkit_converters.hf.expect.check_folder`: presence, counts, shapes, dtypes) and
    the index to agree with the shards."""
    counts = check_folder(files, family, cfg, where, weight_map)
    if weight_map is not None:
        check_index(dict(weight_map), dict(files), f"{where}/{INDEX_NAME}")
    found: dict[tuple[str, int | None], dict[tuple[int | None, int | None], dict[int, tuple[str, str]]]] = {}
    rules: dict[str, Rule] = {}
    for fname, f in files.items():
        for name in f.entries:
            if name.endswith(HF_ONLY):
                continue
            rule, out, layer, expert = match_hf(family, name)[0]
            key = rule.ours.format(l=layer) if rule.per_layer else rule.ours
            group = (key, layer if rule.layer_axis else None)
            slot = found.setdefault(group, {}).setdefault((layer if rule.layer_axis else None, expert), {})
            slot[rule.outs.index(out)] = (fname, name)
            rules[key] = rule
    by_key: dict[str, dict[tuple[int | None, int | None], dict[int, tuple[str, str]]]] = {}
    for (key, _), slots in found.items():
        by_key.setdefault(key, {}).update(slots)
    return [_target(key, rules[key], slots, files, counts.experts, counts.layers, cfg, where)
            for key, slots in sorted(by_key.items())]


def _target(key: str, rule: Rule, slots: dict[tuple[int | None, int | None], dict[int, tuple[str, str]]],
            files: Mapping[str, SafetensorsFile], experts: int, layers: int, cfg: HFConfig, where: str) -> Target:
    layer_range = range(layers) if rule.layer_axis else [None]
    expert_range = range(experts) if rule.expert_axis else [None]
    pieces, first = [], None
    for layer in layer_range:
        for expert in expert_range:
            slot = slots.get((layer, expert), {})
            for i, o in enumerate(rule.outs):
                if i not in slot:
                    lay = layer if layer is not None else _layer_of(key)
                    hf = o.hf.format(l=lay, e=expert)
                    what = ", ".join(x for x in (f"layer {lay}" if lay is not None else "",
                                                 f"expert {expert} (of {experts})" if expert is not None else "") if x)
                    raise MissingKeysError(f"{where}: {what + ': ' if what else ''}no HF tensor {hf!r} "
                                           f"(needed for {key!r})")
            srcs = tuple(slot[i] for i in range(len(rule.outs)))
            entries = [files[f].entries[n] for f, n in srcs]
            sig = [(e.dtype, e.shape) for e in entries]
            if first is None:
                first = sig
            elif sig != first:
                raise CkptkitError(f"{where}: {srcs[0][1]!r} is {sig[0][0]} {list(sig[0][1])}, the other slices of "
                                   f"{key!r} are {first[0][0]} {list(first[0][1])}")
            index = tuple(i for i in (layer, expert) if i is not None)
            pieces.append(Piece(index, srcs, layer, expert))
    assert first is not None
    dtype = first[0][0]
    shape0 = _slice_shape(rule, [s for _, s in first], cfg, f"{where}: {key!r}")
    lead = tuple(n for n, used in ((layers, rule.layer_axis), (experts, rule.expert_axis)) if used)
    return Target(key, rule, (*lead, *shape0), dtype, tuple(pieces))


def _layer_of(key: str) -> int | None:
    parts = key.split(".")
    return int(parts[1]) if len(parts) > 1 and parts[0] == "layers" and (parts[1].isascii() and parts[1].isdigit()) else None


def _slice_shape(rule: Rule, shapes: list[tuple[int, ...]], cfg: HFConfig, where: str) -> tuple[int, ...]:
    takes = [o.take for o in rule.outs]
    if takes in (["q", "k", "v"], ["gate", "up"]):
        if any(s[1:] != shapes[0][1:] for s in shapes):
            raise CkptkitError(f"{where}: the parts {[list(s) for s in shapes]} do not stack along rows")
        return (sum(s[0] for s in shapes), *shapes[0][1:])
    return shapes[0]


def _read_slice(target: Target, piece: Piece, files: Mapping[str, SafetensorsFile], cfg: HFConfig,
                permute: bool, where: str) -> torch.Tensor:
    parts = [files[f].read(n) for f, n in piece.sources]
    return invert(target.rule, parts, cfg, permute, f"{where}: {target.key!r}")


def _family(cfg: HFConfig, family: str | None, naming: str) -> Family:
    if family is not None:
        return family_named(family)
    return family_for(cfg.model_type, naming)


# ---------------------------------------------------------------- entry points


def read_hf(
    source: str | os.PathLike[str],
    config: HFConfig | AttentionHeads | None = None,
    *,
    family: str | None = None,
    naming: str = TORCHTITAN,
    permute_rotary: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """An HF safetensors folder as ``{checkpoint name: tensor}`` (experts stacked, renamed, permuted back).

    Loads everything into memory: meant for models that fit. :func:`import_hf` streams.
    ``config`` / ``family`` / ``naming`` pick the table as the export does (no ``model_type``: Llama).
    """
    cfg = HFConfig.of(config)
    store = open_source(source, storage_options)
    files, weight_map = open_folder(store)
    targets = plan_import(files, _family(cfg, family, naming), cfg, store.url, weight_map)
    out = {}
    for t in targets:
        full = torch.empty(t.shape, dtype=t.dtype)
        for p in t.pieces:
            x = _read_slice(t, p, files, cfg, permute_rotary, store.url)
            if p.index:
                full[p.index] = x
            else:
                full = x
        out[t.key] = full
    return out


class _Pieces:
    """The piece source of :func:`write_offline`: one HF slice (e.g. one expert) assembled per piece."""

    def __init__(self, order: list[tuple[Target, Piece]], files: Mapping[str, SafetensorsFile], cfg: HFConfig,
                 permute: bool, where: str) -> None:
        self.order, self.files, self.cfg, self.permute, self.where = order, files, cfg, permute, where
        self.bytes_read = 0

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, ref: int) -> torch.Tensor:
        target, piece = self.order[ref]
        x = _read_slice(target, piece, self.files, self.cfg, self.permute, self.where)
        self.bytes_read += x.numel() * x.element_size()
        return x.reshape((1,) * len(piece.index) + tuple(x.shape)).contiguous()


def _rule(t: Target, tensors: Mapping[str, StoredTensor], prefix: str, make_vocab_size_divisible_by: int) -> PartitionRule | None:
    if t.rule.layer_axis or t.key.startswith(("embedding.", "output_layer.", "decoder.")):
        from ckptkit_converters.megatron import names as names

        shapes = {k[len(prefix):]: s.shape for k, s in tensors.items() if k.startswith(prefix)}
        return names.rule_for(t.key, divisible_by=make_vocab_size_divisible_by, ffn=names.gated_ffn(t.key, shapes))
    return PartitionRule(expert_axis=0) if t.rule.expert_axis else None


def _layouts(tensors: Mapping[str, StoredTensor], items: list[tuple[str, Region]],
             rules: Mapping[str, PartitionRule | None]) -> dict[str, TensorMeta]:
    """Manifest entries carrying the rules: the pieces sorted exactly as the merge sorts them."""
    by_key: dict[str, list[tuple[Region, int]]] = {k: [] for k in tensors}
    for key, region in items:
        by_key[key].append((region, 0))
    return {k: TensorMeta(k, s.dtype, s.shape, ExplicitLayout(tuple(sorted(by_key[k], key=lambda p: (p[0].key(), p[1])))),
                          rule=rules[k]) for k, s in sorted(tensors.items())}


@divisible_by_renamed
def import_hf(
    source: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    config: HFConfig | AttentionHeads | None = None,
    *,
    family: str | None = None,
    naming: str = TORCHTITAN,
    prefix: str | None = None,
    permute_rotary: bool = True,
    make_vocab_size_divisible_by: int = 128,
    options: HFImportOptions | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> ConvertResult:
    """Write the HF folder ``source`` as a committed ckptkit checkpoint at ``dest`` (tensors under ``prefix``).

    ``prefix``: where the model goes in the checkpoint's state; None: ``"model/"``, where ckptkit's
    adapters keep the model (the export's ``prefix`` None detects it instead); ``""``: the top level.
    ``options`` (:class:`~ckptkit_converters.hf.options.HFImportOptions`) carries all of these at once,
    and a config path (or none: the folder's own ``config.json``), used where ``config`` is not given;
    it replaces the keywords, which are then left out.

    Each routed expert (and, for Megatron names, each layer) is one stored piece, read and written on
    its own: memory is one slice, not the model. ``ckptkit.load`` then reads it at any layout.
    The tensors carry partition rules (docs/moe.md): routed experts ``expert_axis`` (0 for torchtitan's
    ``[E, ...]``; Megatron's ``[layers, E, ...]``: ``layer_axis=0, expert_axis=1``), and for Megatron
    names the rules of :func:`ckptkit_converters.megatron.names.rule_for` (``make_vocab_size_divisible_by``: the
    vocabulary padding multiple a later Megatron export pads to; Megatron's default 128).
    """
    t0 = time.perf_counter()
    if options is not None:
        _keywords_left_out(family, naming, prefix, permute_rotary, make_vocab_size_divisible_by)
        if config is None:
            config = options.hf_config(source, storage_options)
        family, naming, prefix = options.family, options.naming, options.prefix
        permute_rotary, make_vocab_size_divisible_by = options.permute_rotary, options.make_vocab_size_divisible_by
    prefix = MODEL_PREFIX if prefix is None else prefix
    cfg = HFConfig.of(config)
    src = open_source(source, storage_options)
    files, weight_map = open_folder(src)
    targets = plan_import(files, _family(cfg, family, naming), cfg, src.url, weight_map)
    tensors = {prefix + t.key: StoredTensor(str(t.dtype).removeprefix("torch."), t.shape) for t in targets}
    order: list[tuple[Target, Piece]] = []
    items: list[tuple[str, Region]] = []
    for t in targets:
        for p in t.pieces:
            lead = len(p.index)
            box = Box((*p.index, *(0 for _ in t.shape[lead:])), (*(1 for _ in p.index), *t.shape[lead:]))
            order.append((t, p))
            items.append((prefix + t.key, Region(box)))
    out = open_store(dest, storage_options)
    pieces = _Pieces(order, files, cfg, permute_rotary, src.url)
    rules = {prefix + t.key: _rule(t, tensors, prefix, make_vocab_size_divisible_by) for t in targets}
    checkpoint = OfflineCheckpoint(world_size=1, tensors=tensors, pieces={0: items},
                                   layouts=_layouts(tensors, items, rules),
                                   meta={"converted_from": {"url": src.url, "format": "hf"}})
    result = write_offline(out, checkpoint, lambda rank, _: pieces, options=OfflineWriteOptions(threads=1),
                           progress=progress, what=f"importing {src.url} into {out.url}")
    return ConvertResult(src.url, out.url, "ckptkit", len(tensors), result.nbytes, result.bytes_read,
                         time.perf_counter() - t0)


def _keywords_left_out(family: str | None, naming: str, prefix: str | None, permute_rotary: bool,
                       make_vocab_size_divisible_by: int) -> None:
    """With ``options``, :func:`import_hf`'s own keywords keep their defaults: two answers to one question
    (which table, which prefix) would leave it unclear which one counts."""
    given = [name for name, value, default in (("family", family, None), ("naming", naming, TORCHTITAN),
                                               ("prefix", prefix, None), ("permute_rotary", permute_rotary, True),
                                               ("make_vocab_size_divisible_by", make_vocab_size_divisible_by, 128)) if value != default]
    if given:
        raise OptionsError(f"import_hf was given HFImportOptions and {', '.join(given)} as keywords: "
                           f"put {'them' if len(given) > 1 else 'it'} in the options")
